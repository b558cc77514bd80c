// The `ladder sweep` and `ladder report` verbs (src/cli/main.cpp calls these).
#pragma once
#include "ladder/report.h"
#include "ladder/runner.h"

namespace ladder {
int sweep_cli(const SweepOptions& opt);
int report_cli(const ReportOptions& opt);
}  // namespace ladder

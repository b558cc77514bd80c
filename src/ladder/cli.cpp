#include "ladder/cli.h"

#include <fmt/format.h>

namespace ladder {

int sweep_cli(const SweepOptions& opt) {
  SweepSummary s = sweep(opt);
  return s.interrupted ? 130 : 0;  // 130: the shell's code for an interrupted command
}

int report_cli(const ReportOptions& opt) {
  std::string md = write_report(opt);
  fmt::print("{}\nwritten: {}/{{report.md, report.html, loss_vs_compute.svg, speedups.svg, val_curves.svg}}\n", md,
             (opt.out.empty() ? opt.dir / "report" : opt.out).string());
  return 0;
}

}  // namespace ladder

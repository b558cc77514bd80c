// Learning-rate schedules: linear warmup, then linear decay / cosine / WSD (warmup-stable-decay) /
// constant, down to final_lr_frac of the peak. A pure function of the step, so resume is exact.
#pragma once
#include <cstdint>

#include "model/config.h"

namespace ladder {

int64_t warmup_steps(const ScheduleConfig& s, int64_t total_steps);
// Multiplier of the peak learning rate at 0-based step t of total_steps.
double lr_multiplier(const ScheduleConfig& s, int64_t t, int64_t total_steps);

}  // namespace ladder

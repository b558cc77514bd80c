// `ladder plot` (src/train/plot): reading metrics.jsonl into curves, the x axes, the MoE metrics,
// the EMA, the SVG, and the bad-input errors; and the verb on a run the trainer wrote.
#include "train/plot.h"

#include <gtest/gtest.h>

#include <cmath>
#include <fstream>

#include "core/error.h"
#include "core/fileio.h"
#include "model/config.h"
#include "model/flops.h"
#include "test_util.h"
#include "tiny_training.h"

namespace fs = std::filesystem;

namespace ladder {
namespace {

using Pts = std::vector<std::pair<double, double>>;

// Three logged steps of a two-layer MoE run, a validation line between them, as the trainer
// writes them (numbers chosen so that every derived value is distinct).
const char* kMoeMetrics =
    R"({"step":2,"loss":5.0,"lr":0.001,"tokens":200,"elapsed_s":1.0,"mfu":0.4,"tokens_per_s":100,)"
    R"("moe":[{"layer":0,"load_min":2,"load_max":10,"load_mean":5,"dropped_frac":0},)"
    R"({"layer":1,"load_min":1,"load_max":8,"load_mean":4,"dropped_frac":0.5}]})"
    "\n"
    R"({"step":4,"loss":4.0,"lr":0.002,"tokens":400,"elapsed_s":3.0,"mfu":0.6,"tokens_per_s":300,)"
    R"("moe":[{"layer":0,"load_min":4,"load_max":6,"load_mean":5,"dropped_frac":0},)"
    R"({"layer":1,"load_min":3,"load_max":5,"load_mean":4,"dropped_frac":0}]})"
    "\n"
    R"({"step":4,"tokens":400,"val_loss":4.5})"
    "\n\n"
    R"({"step":6,"loss":null,"lr":0.003,"tokens":600,"elapsed_s":7.0,"mfu":0.5,"tokens_per_s":200})"
    "\n"
    R"({"step":5,"tokens":500,"val_loss":4.25})"
    "\n";

TEST(Plot, ReadsEveryMetricAgainstEachAxis) {
  test::TempDir d("plot-read");
  fs::create_directories(d.path / "moe-run");
  write_file_atomic(d.path / "moe-run" / "metrics.jsonl", kMoeMetrics);
  const std::vector<std::string> ys = {"loss", "val_loss", "moe.load_max", "moe.load_min", "moe.dropped_frac",
                                       "moe.load_max_ratio", "moe.load_min_ratio", "lr"};
  RunCurves r = read_run_curves(d.path / "moe-run", "step", ys);
  EXPECT_EQ(r.label, "moe-run");
  // A null loss (a non-finite value the writer nulled) is no point; lines are put in step order.
  EXPECT_EQ(r.series["loss"], (Pts{{2, 5.0}, {4, 4.0}}));
  EXPECT_EQ(r.series["val_loss"], (Pts{{4, 4.5}, {5, 4.25}}));
  EXPECT_EQ(r.series["lr"], (Pts{{2, 0.001}, {4, 0.002}, {6, 0.003}}));
  // The extreme layer: the largest load_max and dropped fraction, the smallest load_min.
  EXPECT_EQ(r.series["moe.load_max"], (Pts{{2, 10}, {4, 6}}));
  EXPECT_EQ(r.series["moe.load_min"], (Pts{{2, 1}, {4, 3}}));
  EXPECT_EQ(r.series["moe.dropped_frac"], (Pts{{2, 0.5}, {4, 0}}));
  // The worst layer's max/mean (10/5 vs 8/4; 6/5 vs 5/4) and min/mean (2/5 vs 1/4; 4/5 vs 3/4).
  EXPECT_EQ(r.series["moe.load_max_ratio"], (Pts{{2, 2.0}, {4, 1.25}}));
  EXPECT_EQ(r.series["moe.load_min_ratio"], (Pts{{2, 0.25}, {4, 0.75}}));
  // Summary: the last train loss (step 6 has none), the last and best validation loss, medians.
  EXPECT_EQ(r.last_step, 6);
  EXPECT_EQ(r.tokens, 600);
  EXPECT_TRUE(r.has_loss);
  EXPECT_EQ(r.last_loss, 4.0);
  EXPECT_TRUE(r.has_val);
  EXPECT_EQ(r.last_val, 4.25);  // step 5's, though it came last in the file
  EXPECT_EQ(r.best_val, 4.25);
  EXPECT_EQ(r.tokens_per_s, 200);
  EXPECT_EQ(r.mfu, 0.5);
  for (const char* m : {"loss", "val_loss", "lr", "mfu", "moe.load_max_ratio", "moe.router_lse_sq"})
    EXPECT_EQ(std::count(r.available.begin(), r.available.end(), m), std::string(m) != "moe.router_lse_sq") << m;

  // Tokens; and time, where a validation line (no elapsed_s) is placed by its step between the
  // lines that carry one: step 5 lies halfway between step 4 (3 s) and step 6 (7 s).
  EXPECT_EQ(read_run_curves(d.path / "moe-run", "tokens", {"val_loss"}).series["val_loss"], (Pts{{400, 4.5}, {500, 4.25}}));
  EXPECT_EQ(read_run_curves(d.path / "moe-run", "time", {"val_loss"}).series["val_loss"], (Pts{{3.0, 4.5}, {5.0, 4.25}}));
  // The file itself as input: labelled by its directory.
  EXPECT_EQ(read_run_curves(d.path / "moe-run" / "metrics.jsonl", "step", {"loss"}).label, "moe-run");
}

TEST(Plot, ComputeAxisUsesTheRunsOwnConfigThroughTheFlopCounter) {
  test::TempDir d("plot-flops");
  Config c;
  c.model.vocab_size = 512;
  c.model.d_model = 64;
  c.model.n_layers = 2;
  c.model.n_heads = 2;
  c.model.n_kv_heads = 2;
  c.model.seq_len = 64;
  fs::create_directories(d.path / "r");
  write_file_atomic(d.path / "r" / "config.yaml", to_yaml(c));
  write_file_atomic(d.path / "r" / "metrics.jsonl", kMoeMetrics);
  RunCurves r = read_run_curves(d.path / "r", "flops", {"loss"});
  const double per_token = run_compute(c.model, 1.0);
  ASSERT_GT(per_token, 0);
  EXPECT_EQ(r.compute_per_token, per_token);
  ASSERT_EQ(r.series["loss"].size(), 2u);
  EXPECT_DOUBLE_EQ(r.series["loss"][0].first, 200 * per_token);
  EXPECT_DOUBLE_EQ(r.series["loss"][1].first, 400 * per_token);
  // By hand (RECIPE.md section 4): 3 x per-layer forward (projections 2*64*(64+128) + 2*64*64,
  // attention 64*(4*64+3*2), MLP 6*64*I) x 2 layers, without the head.
  const double I = c.model.ff();  // 4 d
  EXPECT_DOUBLE_EQ(per_token, 3 * 2 * (2.0 * 64 * 192 + 2.0 * 64 * 64 + 64.0 * (4 * 64 + 3 * 2) + 6.0 * 64 * I));
}

TEST(Plot, BadInputNamesTheFileLineOrFlag) {
  test::TempDir d("plot-bad");
  auto expect_error = [](auto&& f, const std::string& want) {
    try {
      f();
      ADD_FAILURE() << "no error; expected: " << want;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << e.what();
    }
  };
  fs::create_directories(d.path / "bad");
  write_file_atomic(d.path / "bad" / "metrics.jsonl", "{\"step\":1,\"loss\":3}\n{\"step\":2,\"loss\":\n{\"step\":3}\n");
  expect_error([&] { read_run_curves(d.path / "bad", "step", {"loss"}); }, "bad/metrics.jsonl:2: not a JSON object");
  write_file_atomic(d.path / "bad" / "metrics.jsonl", "{\"step\":\"one\",\"loss\":3}\n");
  expect_error([&] { read_run_curves(d.path / "bad", "step", {"loss"}); }, "metrics.jsonl:1: \"step\" is not a number");
  // A live run's last line, still being written (no newline yet), is left out rather than an error.
  write_file_atomic(d.path / "bad" / "metrics.jsonl", "{\"step\":1,\"loss\":3}\n{\"step\":2,\"lo");
  EXPECT_EQ(read_run_curves(d.path / "bad", "step", {"loss"}).series["loss"], (Pts{{1, 3}}));

  expect_error([&] { read_run_curves(d.path / "nowhere", "step", {"loss"}); }, "nowhere: no such file or directory");
  fs::create_directories(d.path / "sweep" / "runs");
  expect_error([&] { read_run_curves(d.path / "sweep", "step", {"loss"}); }, "a ladder results directory? pass its runs");
  fs::create_directories(d.path / "empty");
  expect_error([&] { read_run_curves(d.path / "empty", "step", {"loss"}); }, "empty: no metrics.jsonl");
  // --x flops reads the run's config.yaml beside metrics.jsonl for its FLOPs per token: the error names it.
  expect_error([&] { read_run_curves(d.path / "bad", "flops", {"loss"}); },
               "--x flops: " + (d.path / "bad" / "metrics.jsonl").string() + " has no run config beside it (" +
                   (d.path / "bad" / "config.yaml").string() + " not found)");
  expect_error([&] { read_run_curves(d.path / "bad", "epochs", {"loss"}); }, "--x: unknown axis 'epochs'");

  PlotOptions o;
  o.inputs = {(d.path / "bad").string()};
  o.out = d.path / "p.svg";
  o.y = {"loss", "val_los"};
  expect_error([&] { plot_cli(o); }, "--y val_los: no run has this metric (metrics found: loss)");
  o.y = {"loss"};
  o.labels = {"a", "b"};
  expect_error([&] { plot_cli(o); }, "--label: 2 labels for 1 runs");
  o.labels = {};
  o.smooth = 1;
  expect_error([&] { plot_cli(o); }, "--smooth: 1 is not in [0, 1)");
  EXPECT_FALSE(fs::exists(o.out));  // nothing written on an error
}

TEST(Plot, EmaIsBiasCorrected) {
  EXPECT_EQ(ema({{1, 3}, {2, 5}}, 0), (Pts{{1, 3}, {2, 5}}));
  // A constant stays constant from the first point on (the zero start divided out).
  for (auto [x, v] : ema({{1, 2}, {2, 2}, {3, 2}}, 0.9)) EXPECT_NEAR(v, 2, 1e-12) << x;
  // a = 0.5 on 4, 0: s1 = 2 / 0.5 = 4; s2 = (0.5 * 2 + 0) / 0.75 = 4/3.
  auto e = ema({{1, 4}, {2, 0}}, 0.5);
  EXPECT_NEAR(e[0].second, 4.0, 1e-12);
  EXPECT_NEAR(e[1].second, 4.0 / 3, 1e-12);
}

size_t count(const std::string& s, const std::string& what);

// --xmin/--xmax cut the points outside the range from every curve; the EMA is taken over all of
// them first, so the first point shown keeps its past.
TEST(Plot, XRangeLeavesPointsOut) {
  RunCurves r;
  r.label = "r";
  r.series["loss"] = {{1, 10}, {2, 0}, {3, 0}, {4, 0}};
  r.series["val_loss"] = {{2, 5}, {4, 4}};
  PlotOptions o;
  o.xmin = 2.5;
  std::string svg = curves_svg({r}, o);
  EXPECT_EQ(count(svg, "<circle"), 1u + 1u);  // the val_loss at step 4, and the legend's style marker
  EXPECT_NE(svg.find("val_loss at step 4, 4"), std::string::npos);
  EXPECT_EQ(svg.find("val_loss at step 2"), std::string::npos);
  o.smooth = 0.5;
  o.xmax = 3.5;
  svg = curves_svg({r}, o);
  EXPECT_EQ(count(svg, "<circle"), 1u);  // no validation point in [2.5, 3.5]
  // Step 3 alone: one point, no line (the raw and the smoothed curve each need two).
  EXPECT_EQ(count(svg, "<polyline"), 0u);
  o.xmin = 0;
  svg = curves_svg({r}, o);
  EXPECT_EQ(count(svg, "<polyline"), 2u);  // raw and smoothed loss over steps 1-3
  o.xmin = 5, o.xmax = 1;
  o.inputs = {"anything"};
  try {
    plot_cli(o);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--xmin 5 is not below --xmax 1"), std::string::npos) << e.what();
  }
}

// Parses a file with Python's XML parser (an independent well-formedness check); returns the root tag.
std::string xml_root(const fs::path& f, const fs::path& out) {
  const std::string cmd = fmt::format(
      "/usr/bin/python3 -c \"import sys,xml.etree.ElementTree as E; open(sys.argv[2],'w').write(E.parse(sys.argv[1]).getroot().tag)\" '{}' '{}'",
      f.string(), out.string());
  if (std::system(cmd.c_str()) != 0) return "";
  return read_file(out);
}

size_t count(const std::string& s, const std::string& what) {
  size_t n = 0;
  for (size_t p = s.find(what); p != std::string::npos; p = s.find(what, p + 1)) ++n;
  return n;
}

// The verb on runs the trainer wrote: two runs of the tiny model (the second with other labels),
// every axis, the SVG well-formed with one curve per run and metric, the summary table.
TEST(Plot, PlotsRunsTheTrainerWrote) {
  test::TempDir d("plot-train");
  test::make_word_salad_data(d.path, 200, 3);
  Config c = test::tiny_train_config(d.path);
  c.run.steps = 6;
  c.run.eval_every = 3;
  c.run.ckpt_every = 0;
  test::train_quietly(c, d.path / "a");
  c.optim.lr = 1e-3;
  test::train_quietly(c, d.path / "b");

  for (const char* x : {"step", "tokens", "flops", "time"}) {
    PlotOptions o;
    o.inputs = {(d.path / "a").string(), (d.path / "b" / "metrics.jsonl").string()};
    o.x = x;
    o.y = {"loss", "val_loss", "lr", "grad_norm"};
    o.out = d.path / fmt::format("{}.svg", x);
    o.smooth = std::string(x) == "time" ? 0.5 : 0;
    o.log_x = std::string(x) == "tokens";
    ASSERT_EQ(plot_cli(o), 0);
    const std::string svg = read_file(o.out);
    EXPECT_EQ(xml_root(o.out, d.path / "root"), "{http://www.w3.org/2000/svg}svg") << x;
    // Three panels (loss with val_loss, lr, grad_norm), both runs in each legend.
    EXPECT_EQ(count(svg, ">a</text>"), 3u) << x;
    EXPECT_EQ(count(svg, ">b</text>"), 3u) << x;
    // Curves: per run, loss + lr + grad_norm solid (loss and grad_norm twice under the EMA, the
    // raw one faint; lr, a schedule, never smoothed) and val_loss dashed with a marker per
    // evaluation (steps 3 and 6).
    const size_t solid = o.smooth > 0 ? 2 * 2 + 1 : 3;
    EXPECT_EQ(count(svg, "<polyline"), 2 * (solid + 1)) << x;
    EXPECT_EQ(count(svg, "stroke-opacity"), o.smooth > 0 ? 2u * 2 : 0u) << x;
    EXPECT_EQ(count(svg, ": val_loss at "), 2u * 2) << x;
  }

  RunCurves a = read_run_curves(d.path / "a", "step", {"loss"});
  EXPECT_EQ(a.last_step, 6);
  EXPECT_EQ(a.series["loss"].size(), 6u);
  EXPECT_TRUE(a.has_val);
  EXPECT_GT(a.tokens_per_s, 0);
  const std::string table = curves_summary({a});
  EXPECT_NE(table.find("run"), std::string::npos);
  EXPECT_NE(table.find(fmt::format("{:.4f}", a.last_loss)), std::string::npos) << table;
  EXPECT_NE(table.find(fmt::format("{:.4f}", a.best_val)), std::string::npos) << table;

  // The command line: runs named alike get their parents' names; a bad flag value is one line.
  fs::create_directories(d.path / "s1");
  fs::create_directories(d.path / "s2");
  fs::copy(d.path / "a", d.path / "s1" / "run", fs::copy_options::recursive);
  fs::copy(d.path / "b", d.path / "s2" / "run", fs::copy_options::recursive);
  const std::string bin = fmt::format("{}/ladder", LADDER_BINARY_DIR);
  const fs::path out = d.path / "out", err = d.path / "err", svg = d.path / "cli.svg";
  int rc = std::system(fmt::format("{} plot {} {} --y loss,lr --out {} >{} 2>{}", bin, (d.path / "s1" / "run").string(),
                                   (d.path / "s2" / "run").string(), svg.string(), out.string(), err.string())
                           .c_str());
  EXPECT_EQ(rc, 0) << read_file(err);
  EXPECT_NE(read_file(out).find("s1/run"), std::string::npos) << read_file(out);
  EXPECT_NE(read_file(svg).find(">s2/run</text>"), std::string::npos);
  rc = std::system(
      fmt::format("{} plot {} --x epoch >{} 2>{}", bin, (d.path / "a").string(), out.string(), err.string()).c_str());
  EXPECT_NE(rc, 0);
  EXPECT_NE(read_file(err).find("error: --x: unknown axis 'epoch'"), std::string::npos) << read_file(err);
}

}  // namespace
}  // namespace ladder

// `ladder inspect`: what training did to each weight matrix of a checkpoint. For every tensor its
// role, the optimizer that trained it, its RMS and Frobenius norm, and for matrices the largest
// singular value and the stable rank ||W||_F^2 / sigma_1^2 (how many directions carry its norm; an
// expert tensor [E, out, in] as the mean over its E matrices). Why: two optimizers can hold a matrix
// at the same norm (the hyperball ones, AdamH and MuonH, keep ||W||_F at its init value) and still
// shape it differently, e.g. AdamH concentrating a matrix's norm in a few directions where MuonH's
// orthogonalized updates keep it spread (results/cpu-muonh-tune).
#pragma once
#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace ladder {

struct InspectOptions {
  std::string params;  // selectors as in optim.<opt>_params ("role:gated_norm, *.q_proj.weight"); "" = every tensor
  int threads = 0;     // CPU threads for the Gram matrices (0 = all)
};

struct TensorStats {
  std::string name, role;
  std::string optimizer;  // "" when the checkpoint's optimizer settings cannot be read (InspectResult::note)
  std::vector<int64_t> shape;
  int64_t matrices = 0;   // 0 for a vector, 1 for a matrix, E for an expert tensor [E, out, in]
  double rms = 0, frobenius = 0;  // of the whole tensor
  // Matrices only, the mean over the tensor's matrices (the min and max of the stable rank beside it):
  double sigma1 = 0;                  // largest singular value
  double stable_rank = 0, stable_rank_min = 0, stable_rank_max = 0;  // ||W||_F^2 / sigma1^2, in [1, rank_bound]
  double matrix_frobenius = 0;        // of one matrix (the mean over an expert tensor's)
  int64_t rank_bound = 0;             // min(rows, cols)
};

struct InspectResult {
  std::filesystem::path checkpoint;
  int64_t step = 0;
  std::string optimizer_preset;  // optim.name of the checkpoint's config
  std::string note;              // why the optimizer column is empty, if it is
  std::vector<TensorStats> tensors;
};

// The singular values of a rows x cols row-major matrix, largest first (min(rows, cols) of them),
// through the eigenvalues of its smaller Gram matrix in double precision (LAPACK dsyev).
std::vector<double> singular_values(const float* a, int64_t rows, int64_t cols);

// `checkpoint`: a checkpoint directory, or a run directory (its latest). The weights are loaded and
// checked as `ladder eval` loads them; errors name the file, the tensor or the selector.
InspectResult inspect_checkpoint(const std::filesystem::path& checkpoint, const InspectOptions& opt = {});
std::string format_inspect(const InspectResult& r);
nlohmann::json to_json(const InspectResult& r);

}  // namespace ladder

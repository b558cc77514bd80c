#include "core/yaml_keys.h"

#include <map>

#include "core/error.h"

namespace ladder {

void reject_duplicate_keys(const YAML::Node& node, const std::string& file, const std::string& prefix) {
  if (node.IsSequence()) {
    for (size_t i = 0; i < node.size(); ++i) reject_duplicate_keys(node[i], file, fmt::format("{}[{}]", prefix, i));
    return;
  }
  if (!node.IsMap()) return;
  std::map<std::string, int> seen;  // key -> line
  for (auto it = node.begin(); it != node.end(); ++it) {
    if (!it->first.IsScalar()) continue;
    const int line = it->first.Mark().line + 1;
    const std::string key = prefix.empty() ? it->first.Scalar() : prefix + "." + it->first.Scalar();
    if (auto [at, fresh] = seen.emplace(it->first.Scalar(), line); !fresh)
      fail("{}:{}: '{}' is given twice (lines {} and {}): keep one", file, line, key, at->second, line);
    reject_duplicate_keys(it->second, file, key);
  }
}

}  // namespace ladder

#include "core/yaml_keys.h"

#include <map>

#include "core/error.h"

namespace ladder {

YAML::Node load_yaml_file(const std::filesystem::path& file, const std::string& what) {
  std::error_code ec;
  // yaml-cpp opens a directory and then fails reading it with a stream error that names no file.
  if (std::filesystem::is_directory(file, ec)) fail("{}: is a directory, expected a {} (a YAML file)", file.string(), what);
  try {
    return YAML::LoadFile(file.string());
  } catch (const YAML::BadFile&) {
    fail("{}: cannot read {} (no such file, or not readable)", file.string(), what);
  } catch (const YAML::ParserException& e) {
    fail("{}:{}:{}: malformed YAML: {}", file.string(), e.mark.line + 1, e.mark.column + 1, e.msg);
  } catch (const std::ios_base::failure& e) {
    fail("{}: cannot read {}: {}", file.string(), what, e.what());
  }
}

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

// Reading YAML input (configs, ladder specs): the file, and duplicate keys.
#pragma once
#include <yaml-cpp/yaml.h>

#include <filesystem>
#include <string>

namespace ladder {

// The YAML document in `file`; errors name it: "FILE: cannot read <what>" (missing, unreadable, a
// directory) or "FILE:LINE:COL: malformed YAML: ...".
YAML::Node load_yaml_file(const std::filesystem::path& file, const std::string& what);

// YAML forbids a key twice in one mapping, but yaml-cpp keeps both pairs: a lookup (node["seeds"])
// silently takes the first and a walk over the pairs the last, while the one being edited is
// usually the first. Fails with "FILE:LINE: 'a.b' is given twice (lines X and Y): keep one" for
// the first such key anywhere under `node` (mappings inside lists too: 'scales.list[2].d').
// Keys that are not scalars are left to the caller's own checks.
void reject_duplicate_keys(const YAML::Node& node, const std::string& file, const std::string& prefix = "");

}  // namespace ladder

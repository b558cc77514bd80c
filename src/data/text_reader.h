// Reading documents from corpus files (plain text or JSONL, optionally .gz / .zst compressed).
#pragma once
#include <filesystem>
#include <functional>
#include <string>

namespace ladder::data {

enum class TextFormat { Plain, Jsonl };
enum class Compression { None, Gzip, Zstd };

// What for_each_document will do with `file`, from its name: ".gz"/".zst" is stripped first, then
// .txt/.text/.md/no extension = Plain, .jsonl/.json = Jsonl (case-insensitive). Any other extension
// is an error naming the file, rather than a guess that might tokenize binary data.
void detect_format(const std::filesystem::path& file, TextFormat* format, Compression* compression);

// Calls fn for each document of `file`, in file order.
//  Plain: documents are separated by 2+ consecutive empty (whitespace-only) lines; a file without such
//         a separator is one document. Leading/trailing empty lines of a document are dropped, single
//         empty lines inside it kept, "\r\n" read as "\n".
//  JSONL: one JSON object per line with a string field "text" (other fields ignored); blank lines
//         are skipped; anything else is an error "file:line: ...".
// Whitespace-only documents are skipped in both formats. Compressed input must be whole: truncated or
// corrupt data, a .gz that is not gzip (or is empty) and bytes after the last gzip member are errors
// naming the file; concatenated gzip members read as one stream.
void for_each_document(const std::filesystem::path& file, const std::function<void(std::string&&)>& fn);

}  // namespace ladder::data

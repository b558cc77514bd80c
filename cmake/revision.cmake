# Writes OUT (a header defining LADDER_REVISION) from `git describe --always --dirty` of SRC, or
# "unknown" outside a git checkout. Run at every build; the header is replaced only when the text
# changes, so an unchanged revision recompiles nothing.
execute_process(COMMAND git describe --always --dirty --tags WORKING_DIRECTORY "${SRC}"
                OUTPUT_VARIABLE rev OUTPUT_STRIP_TRAILING_WHITESPACE RESULT_VARIABLE rc ERROR_QUIET)
if(NOT rc EQUAL 0 OR rev STREQUAL "")
  set(rev "unknown")
endif()
set(text "#pragma once\n#define LADDER_REVISION \"${rev}\"\n")
if(EXISTS "${OUT}")
  file(READ "${OUT}" old)
else()
  set(old "")
endif()
if(NOT old STREQUAL text)
  file(WRITE "${OUT}" "${text}")
endif()

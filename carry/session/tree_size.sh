#!/bin/bash
# What a device call would carry (tracked and untracked-not-ignored files present in the tree, plus the carried
# .whl/), against the 64 MiB limit: run it here after moving folders out, before the first call.
cd "$(git rev-parse --show-toplevel)"
bytes=$( { git ls-files -co --exclude-standard -z | xargs -0 stat -c %s 2>/dev/null; find .whl -type f -printf '%s\n'; } \
  | awk '{s += $1} END {print s + 0}')
echo "$((bytes / 1048576)) MiB of 64 ($bytes bytes)"
[ $bytes -le $((64 * 1048576)) ]

#!/bin/bash
# Here (not on the device): download the pure-Python wheels the device image lacks into .whl/ (git-ignored via
# .git/info/exclude), then name ".whl" in the device call's carry.
grep -qx '/.whl/' .git/info/exclude || echo /.whl/ >> .git/info/exclude
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \
  tyro docstring-parser typeguard shtab rich markdown-it-py mdurl pygments gymnasium cloudpickle \
  farama-notifications tqdm pytest pluggy iniconfig typing-extensions packaging

#!/bin/sh
# Removes from a virtualenv what an agent never loads at run time, to fit small boards' disks:
#
#   prune-venv.sh VENV        # e.g. /opt/senseshield/venv
#
#   - torch/include and torch/share/cmake: torch's C++ headers and CMake files, read only to
#     build C++ extensions (torch.utils.cpp_extension, torch.compile's C++ backend), which
#     no job does;
#   - torch/test: C++ test programs (in some torch wheels);
#   - onnx/backend/test/data: the ONNX backend conformance suite's models and data (the
#     package onnx.backend.test stays importable);
#   - every package's `tests` directories (numpy, sympy, networkx, mpmath, scipy, ...):
#     their own test suites, which no module imports (torch's are kept: torch.fx.passes
#     imports its `tests` package).
#
# Only directories go, never a module a package imports: compiled files (.pyc) stay, so the
# agent's start is not slowed. pip still lists each distribution (its RECORD names the
# removed files; `pip uninstall` skips them). pip puts them back when it reinstalls a
# package, so run this after every install. It only removes: running it again removes
# nothing. Prints "removed N MiB" (0 when there was nothing to remove).
# Used by the edge_agent role (edge_agent_prune_venv) and deploy/pi/prove_arm64.sh.
set -eu
venv=${1:?usage: prune-venv.sh VENV}
total=0
for site in "$venv"/lib/python3*/site-packages; do
    [ -d "$site" ] || continue
    before=$(du -sk "$site" | cut -f1)
    for d in torch/include torch/share/cmake torch/test onnx/backend/test/data; do
        [ ! -d "$site/$d" ] || rm -rf "${site:?}/$d"
    done
    find "$site" -mindepth 2 -type d -name tests -not -path "$site/torch/*" -prune -exec rm -rf {} +
    after=$(du -sk "$site" | cut -f1)
    total=$((total + before - after))
done
echo "removed $((total / 1024)) MiB"

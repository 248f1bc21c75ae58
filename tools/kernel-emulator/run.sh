#!/usr/bin/env bash
# CPU emulation check of kernels/ctc_frame.cu and kernels/emission_tree.cu (and top_k.cu, which the
# n-best uses) against the numpy CTC prefix search.  Usage: run.sh REPO   (REPO: a gpudecode checkout)
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "${1:?usage: run.sh REPO}" && pwd)"
[ -f "$REPO/kernels/ctc_frame.cu" ] && [ -d "$REPO/gpudecode" ] || { echo "not a gpudecode checkout: $REPO" >&2; exit 2; }
cd "$HERE"
PYTHONPATH="$HERE/fakecupy:$HERE/emu:$REPO" PYTHONDONTWRITEBYTECODE=1 exec python "$HERE/cases.py"

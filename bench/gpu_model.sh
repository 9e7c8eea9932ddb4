# Sourced by the GPU scripts (bench/panel_gpu.sh, bench/retention_gpu.sh) on the GPU machine: install the carried
# wheels (.whl) into /tmp/site once, and join the model NAME's carried pieces (/tmp/carry/NAME/p*, sha256 checked
# against .carry/NAME.sha256) into /tmp/NAME once. Sets $model. Usage: source bench/gpu_model.sh NAME
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
fi
model=/tmp/$1
if [ ! -f "$model" ]; then
  cat /tmp/carry/$1/p* > "$model.tmp"
  [ "$(sha256sum "$model.tmp" | cut -d' ' -f1)" = "$(cat .carry/$1.sha256)" ] || { echo "a piece of $1 is missing"; exit 1; }
  mv "$model.tmp" "$model"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

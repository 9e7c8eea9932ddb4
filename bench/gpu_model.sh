# Sourced by the GPU scripts (bench/issue35_gpu.sh, bench/panel_gpu.sh, bench/peers_gpu.sh, bench/retention_gpu.sh) on
# the GPU machine: install the carried wheels (.whl) into /tmp/site once, and join the model NAME's carried pieces
# (/tmp/carry/NAME/p*) into /tmp/NAME once, sha256 checked against .carry/NAME.sha256 or, where this call did not carry
# it (a detached step launched from a later call), the copy `issue35_gpu.sh piece` and `peers_gpu.sh setup` keep in
# /tmp/carry/. Sets $model. Usage: source bench/gpu_model.sh NAME
if [ -d .whl ] && [ ! -d /tmp/site ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site.$$ .whl/*.whl || exit 1
  mv -T /tmp/site.$$ /tmp/site 2>/dev/null || rm -rf /tmp/site.$$  # atomic: a detached step may be doing the same
fi
model=/tmp/$1
if [ ! -f "$model" ]; then
  sums=.carry/$1.sha256; [ -f "$sums" ] || sums=/tmp/carry/$1.sha256
  [ -f "$sums" ] || { echo "no sha256 of $1: carry .carry/$1.sha256 in this call or with its pieces"; exit 1; }
  cat /tmp/carry/$1/p* > "$model.$$"
  [ "$(sha256sum "$model.$$" | cut -d' ' -f1)" = "$(cat "$sums")" ] || { echo "a piece of $1 is missing"; exit 1; }
  mv "$model.$$" "$model"
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader

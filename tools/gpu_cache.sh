# Compiler caches for the lent GPU machine, kept in the checkout so later device calls can carry them.
#
# On a fresh machine the K3 model's first step spends minutes in fla's Triton autotuning (a ptxas run per
# autotune config of each KDA kernel) and in Inductor compiling the golden glue (benchmarks/README.md).
# Triton caches compiled kernels and autotune results under TRITON_CACHE_DIR and Inductor its FX graphs and
# kernels under TORCHINDUCTOR_CACHE_DIR; both are keyed by source, options and GPU, so a cache written on
# one H200 serves the next one.
#
#   on the device:   source tools/gpu_cache.sh use     # before the run (uses .gpu/cache when carried)
#                    ... python3 tools/benchmark.py ...
#                    bash tools/gpu_cache.sh pack       # after it: $OUT/gpu_cache.tgz.partNN (15 MiB parts)
#   here:            bash tools/gpu_cache.sh unpack /work/.device/N
#                    then add ".gpu/cache" to the next call's carry list (64 MiB in all)
#
# unpack slims the cache to what a later run loads, since the full one does not fit the carry limit (166 MiB
# after the first k3-mini benchmark, 2026-12-02): Triton keeps per kernel its metadata .json, the .cubin and
# the launcher .so, and its group files are rewritten to list only those (Triton loads a cached kernel from
# the binary; the .ptx/.llir/.ttgir/.ttir/.source stages are for inspection), plus fla's autotune results
# (*.autotune.json); Inductor's FX-graph and AOT-autograd caches are dropped (Inductor lowers the glue again,
# and its Triton kernels then hit the Triton cache). 32 + 5 MiB that day.
_k3_cache_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/.gpu/cache"
case "${1:-}" in
  use)
    mkdir -p "$_k3_cache_root/triton" "$_k3_cache_root/inductor"
    export TRITON_CACHE_DIR="$_k3_cache_root/triton" TORCHINDUCTOR_CACHE_DIR="$_k3_cache_root/inductor"
    echo "gpu_cache: TRITON_CACHE_DIR=$TRITON_CACHE_DIR ($(du -sh "$TRITON_CACHE_DIR" | cut -f1)), TORCHINDUCTOR_CACHE_DIR=$TORCHINDUCTOR_CACHE_DIR ($(du -sh "$TORCHINDUCTOR_CACHE_DIR" | cut -f1))"
    ;;
  pack)
    # files come back from $OUT at most 16 MiB each: the archive is split into 15 MiB parts
    limit_mib="${2:-40}"
    tgz="${OUT:?pack writes to \$OUT}/gpu_cache.tgz"
    tar -C "$(dirname "$_k3_cache_root")" -czf "$tgz" cache
    size_mib=$(( $(stat -c %s "$tgz") / 1048576 ))
    if [ "$size_mib" -gt "$limit_mib" ]; then
      echo "gpu_cache: the cache archive is $size_mib MiB (> $limit_mib MiB, too large to carry): not returned" >&2
    else
      split -b 15M -d "$tgz" "$OUT/gpu_cache.tgz.part"
      echo "gpu_cache: $size_mib MiB in $(ls "$OUT"/gpu_cache.tgz.part* | wc -l) part(s) under \$OUT"
    fi
    rm -f "$tgz"
    ;;
  unpack)
    dir="${2:?usage: gpu_cache.sh unpack DIR (the folder holding gpu_cache.tgz.part*)}"
    mkdir -p "$(dirname "$_k3_cache_root")"
    rm -rf "$_k3_cache_root"
    cat "$dir"/gpu_cache.tgz.part* | tar -C "$(dirname "$_k3_cache_root")" -xzf -
    rm -rf "$_k3_cache_root/inductor/fxgraph" "$_k3_cache_root/inductor/aotautograd"
    python3 - "$_k3_cache_root/triton" <<'PY'
import glob, json, os, sys
for grp in glob.glob(os.path.join(sys.argv[1], "*", "__grp__*.json")):
    with open(grp) as f:
        d = json.load(f)
    keep = {c: p for c, p in d["child_paths"].items() if c.endswith((".json", ".cubin", ".so"))}
    for c in set(d["child_paths"]) - set(keep):
        path = os.path.join(os.path.dirname(grp), c)
        if os.path.exists(path):
            os.remove(path)
    d["child_paths"] = keep
    with open(grp, "w") as f:
        json.dump(d, f)
PY
    echo "gpu_cache: $(du -sh "$_k3_cache_root" | cut -f1) in $_k3_cache_root; carry \".gpu/cache\""
    ;;
  *)
    echo "usage: source tools/gpu_cache.sh use | bash tools/gpu_cache.sh pack [LIMIT_MIB] | bash tools/gpu_cache.sh unpack DIR" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac

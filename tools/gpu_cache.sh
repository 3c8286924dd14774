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
    echo "gpu_cache: $(du -sh "$_k3_cache_root" | cut -f1) in $_k3_cache_root; carry \".gpu/cache\""
    ;;
  *)
    echo "usage: source tools/gpu_cache.sh use | bash tools/gpu_cache.sh pack [LIMIT_MIB] | bash tools/gpu_cache.sh unpack DIR" >&2
    return 2 2>/dev/null || exit 2
    ;;
esac

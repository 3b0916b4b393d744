#!/bin/sh
# Prints MAX_JOBS for flash-attn's compile: how many nvcc processes this build machine's memory
# holds at once. Each job runs min(NVCC_THREADS, number of architectures) nvcc threads (nvcc's
# --threads parallelises over the -gencode targets), and each thread peaks at about
# NVCC_GIB_PER_THREAD GiB. The memory is MemAvailable, or the build container's cgroup limit when
# that is lower. The result is clamped to [1, CPUs / threads per job].
#
# Inputs (environment): NVCC_THREADS, NVCC_GIB_PER_THREAD, FLASH_ATTN_CUDA_ARCHS; MEMINFO,
# CGROUP_MEMORY_MAX and CPUS replace /proc/meminfo, /sys/fs/cgroup/memory.max and `nproc` (tests).
set -eu

threads=${NVCC_THREADS:?NVCC_THREADS is not set}
per_thread=${NVCC_GIB_PER_THREAD:?NVCC_GIB_PER_THREAD is not set}
archs=${FLASH_ATTN_CUDA_ARCHS:?FLASH_ATTN_CUDA_ARCHS is not set}
meminfo=${MEMINFO:-/proc/meminfo}
cgroup=${CGROUP_MEMORY_MAX:-/sys/fs/cgroup/memory.max}
cpus=${CPUS:-$(nproc)}

n_archs=$(printf '%s\n' "$archs" | tr ';' '\n' | grep -c .)
[ "$n_archs" -lt "$threads" ] && threads=$n_archs
[ "$threads" -lt 1 ] && threads=1

mem_kib=$(awk '/^MemAvailable:/ {print $2}' "$meminfo")
if [ -r "$cgroup" ]; then
    limit=$(cat "$cgroup")
    if [ "$limit" != max ] && [ $((limit / 1024)) -lt "$mem_kib" ]; then
        mem_kib=$((limit / 1024))
    fi
fi

jobs=$((mem_kib / (threads * per_thread * 1048576)))
most=$((cpus / threads))
[ "$most" -lt 1 ] && most=1
[ "$jobs" -gt "$most" ] && jobs=$most
[ "$jobs" -lt 1 ] && jobs=1
echo "$jobs"

#!/bin/bash
# The whole 1M-token RULER command on the CPU, as a new user runs it, with its resident memory sampled.
#
# A tiny Llama (2 layers, hidden 64, 4 heads of 16, 2 KV heads; the default run's vocabulary) trained for 2 steps
# on Ulysses over 4 simulated CPU devices, then one RULER case by generation at 1,048,576 tokens, the prompt
# prefilled in chunks of 8K (`prefill_chunk=8192`: 128 chunk programs). GNU time records the peak resident set;
# a loop samples the process's VmRSS, VmHWM (kB) and CPU seconds every 20 s into rss.csv, and the chunks done (the
# prefill bar's last count on stderr) into chunks.csv. Hours on 2 cores: chunk j's (1-based) attention reads j chunks
# of the cache. Results: experiments/results/host_memory_ruler_cpu.md ("At 1M"); the plot and the peak chunk by chunk:
#   python experiments/plot_rss.py OUT/rss.csv --estimate 11.01 --loop 9.50 --chunks OUT/chunks.csv --out rss.png
#
#   bash experiments/hostmem_1m_run.sh /tmp/r1m
set -u
OUT=${1:?usage: hostmem_1m_run.sh OUT_DIR}
mkdir -p "$OUT" && cd "$OUT" || exit 2
export XLA_FLAGS=--xla_force_host_platform_device_count=4 JAX_PLATFORMS=cpu
if [ ! -d runs/tiny/checkpoints ]; then  # a run is never overwritten: a second call reuses it
    python -m jaxlong.train run_dir=runs run_name=tiny steps=2 model.layers=2 model.hidden=64 model.heads=4 \
        model.kv_heads=2 model.head_dim=16 model.mlp_hidden=128 mesh.num_devices=4 mesh.fsdp=1 mesh.context=4 \
        seq_len=1024 global_batch=1 > train.log 2>&1 || exit 1
fi
rm -f rc.txt rss.csv chunks.csv start.txt end.txt
echo "unix_time,pid,vm_rss_kb,vm_hwm_kb,cpu_seconds" > rss.csv
echo "unix_time,chunks_done" > chunks.csv
date -u +%FT%TZ > start.txt
/usr/bin/time -v python -m jaxlong.eval runs/tiny --ruler --ruler-tasks niah_single_1 --ruler-lengths 1048576 \
    --ruler-cases 1 --no-passkey --batches 1 prefill_chunk=8192 > eval.out 2> eval.err &
timer=$!
while kill -0 "$timer" 2> /dev/null; do  # the eval command is GNU time's child
    pid=$(pgrep -P "$timer" | head -1)
    if [ -n "$pid" ] && [ -r /proc/"$pid"/status ]; then
        rss=$(awk '/VmRSS/{print $2}' /proc/"$pid"/status)
        hwm=$(awk '/VmHWM/{print $2}' /proc/"$pid"/status)
        cpu=$(awk '{print ($14+$15)/100}' /proc/"$pid"/stat)
        echo "$(date +%s),$pid,$rss,$hwm,$cpu" >> rss.csv
    fi
    n=$(tail -c 400 eval.err 2> /dev/null | grep -ao 'chunk [0-9]*/' | tail -1 | tr -dc 0-9)
    echo "$(date +%s),$n" >> chunks.csv
    sleep 20
done
wait "$timer"
echo $? > rc.txt
date -u +%FT%TZ > end.txt

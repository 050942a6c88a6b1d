#!/usr/bin/env bash
# A deployed federation for issue 31's acceptance: own Mosquitto, a cloud, 2 edges, 6 devices
# (d4, d5 thin onnx), each role serving --metrics-port; a watcher in tmux; d2 killed -9 mid-run.
set -u
W=${1:?usage: run.sh SCRATCH_DIR}; mkdir -p "$W"; cd "$W"; rm -rf shards runs logs; mkdir -p logs
SE=${SPLITEDGE:-splitedge}
PORT=18931
cat > mosq.conf <<CONF
listener $PORT 127.0.0.1
allow_anonymous true
max_packet_size 100000000
persistence false
CONF
mosquitto -c mosq.conf > logs/mosquitto.log 2>&1 & echo $! > pids
B=mqtt://127.0.0.1:$PORT
$SE data split --dataset digits --devices 6 --edges 2 --out shards > logs/split.log 2>&1
export OMP_NUM_THREADS=1
$SE cloud --broker $B --run fed31 --edges 2 --devices 6 --rounds 12 --out runs/cloud --metrics-port 9301 > logs/cloud.log 2>&1 & echo $! >> pids
for e in 0 1; do $SE edge --broker $B --run fed31 --id e$e --metrics-port 930$((e+2)) > logs/e$e.log 2>&1 & echo $! >> pids; done
for d in 0 1 2 3 4 5; do
  be=torch; [ $d -ge 4 ] && be=onnx
  $SE device --broker $B --run fed31 --id d$d --edge e$((d%2)) --data shards/shard-d$d.npz --backend $be --metrics-port 931$d > logs/d$d.log 2>&1 &
  echo $! > d$d.pid; cat d$d.pid >> pids
done

#!/bin/bash
OUTDIR=$1
# the main job with its driver (the router's threads) held on core 0 once Ray's processes are up
rm -rf $OUTDIR
pdlab run report=false hydra.run.dir=$OUTDIR > $OUTDIR.log 2>&1 &
job=$!
drv=""
until [ -n "$drv" ]; do sleep 0.2; drv=$(pgrep -f "hydra.run.dir=$OUTDIR" | head -1); done
until pgrep -f "ray/core/src/ray/raylet/raylet" > /dev/null; do sleep 0.2; done
sleep 1
echo "driver $drv raylet $(pgrep -f ray/core/src/ray/raylet/raylet)" > $OUTDIR.pin.log
while kill -0 $job 2>/dev/null; do
  taskset -a -p -c 0 $drv > /dev/null 2>&1
  sleep 0.5
done
echo done >> $OUTDIR.pin.log

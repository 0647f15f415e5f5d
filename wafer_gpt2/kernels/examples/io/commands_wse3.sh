#!/usr/bin/env bash

set -e

cslc --arch=wse3 ./layout.csl --fabric-dims=9,4 --fabric-offsets=4,1 --params=top_k:4 \
--params=MEMCPYH2D_DATA_1_ID:14,MEMCPYD2H_DATA_1_ID:15 -o out --memcpy --channels=1
cs_python run.py --name out

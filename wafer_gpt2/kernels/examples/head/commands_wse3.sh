#!/usr/bin/env bash

set -e

cslc --arch=wse3 ./layout.csl --fabric-dims=12,8 --fabric-offsets=4,1 \
--params=rows:3,cols:4,tile_k:4,tile_n:24,vocab:90,top_k:8,topk_bins:4,chunk:4,workers:2 \
--params=MEMCPYH2D_DATA_1_ID:17,MEMCPYD2H_DATA_1_ID:18 -o out --memcpy --channels=1
cs_python run.py --name out

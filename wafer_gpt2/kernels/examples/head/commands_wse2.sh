#!/usr/bin/env bash

set -e

cslc --arch=wse2 ./layout.csl --fabric-dims=11,8 --fabric-offsets=4,1 \
--params=rows:2,cols:4,tile_k:6,tile_n:25,vocab:90,top_k:8,topk_bins:4,topk_block:2 \
--params=MEMCPYH2D_DATA_1_ID:17,MEMCPYD2H_DATA_1_ID:18 -o out --memcpy --channels=1
cs_python run.py --name out

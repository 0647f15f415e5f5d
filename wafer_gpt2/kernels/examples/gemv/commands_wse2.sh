#!/usr/bin/env bash

set -e

# a chain reduction over the 7 rows
cslc --arch=wse2 ./layout.csl --fabric-dims=13,9 --fabric-offsets=4,1 \
--params=rows:7,cols:3,tile_k:8,tile_n:6,use_fp16:0,gelu:1,run:0,norm:0,ends:0 \
--params=MEMCPYH2D_DATA_1_ID:8,MEMCPYD2H_DATA_1_ID:9 -o out_chain --memcpy --channels=1
cs_python run.py --name out_chain

# a two-level reduction: runs of 3 rows, then the runs' ends (fp16 weights)
cslc --arch=wse2 ./layout.csl --fabric-dims=13,9 --fabric-offsets=4,1 \
--params=rows:7,cols:3,tile_k:8,tile_n:6,use_fp16:1,gelu:1,run:3,norm:0,ends:0 \
--params=MEMCPYH2D_DATA_1_ID:8,MEMCPYD2H_DATA_1_ID:9 -o out_two_level --memcpy --channels=1
cs_python run.py --name out_two_level

# a three-level reduction: runs of 2 rows, their ends in runs of 3, then those runs' ends
cslc --arch=wse2 ./layout.csl --fabric-dims=13,14 --fabric-offsets=4,1 \
--params=rows:12,cols:3,tile_k:8,tile_n:6,use_fp16:0,gelu:0,run:2,norm:0,ends:3 \
--params=MEMCPYH2D_DATA_1_ID:8,MEMCPYD2H_DATA_1_ID:9 -o out_three_level --memcpy --channels=1
cs_python run.py --name out_three_level

# a LayerNorm folded in: x raw, its statistics made by the strip the lanes pass (runs of 3 rows)
cslc --arch=wse2 ./layout.csl --fabric-dims=13,9 --fabric-offsets=4,1 \
--params=rows:7,cols:3,tile_k:8,tile_n:6,use_fp16:0,gelu:0,run:3,norm:1,ends:0 \
--params=MEMCPYH2D_DATA_1_ID:8,MEMCPYD2H_DATA_1_ID:9 -o out_norm --memcpy --channels=1
cs_python run.py --name out_norm

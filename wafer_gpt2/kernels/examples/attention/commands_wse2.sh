#!/usr/bin/env bash

set -e

cslc --arch=wse2 ./layout.csl --fabric-dims=11,5 --fabric-offsets=4,1 \
--params=row_len:2,fold:3,ppp:2,slots:2,hpp:2,head_dim:4 \
--params=MEMCPYH2D_DATA_1_ID:8,MEMCPYD2H_DATA_1_ID:9 -o out --memcpy --channels=1
cs_python run.py --name out

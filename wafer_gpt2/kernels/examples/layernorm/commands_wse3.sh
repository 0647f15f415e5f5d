#!/usr/bin/env bash

set -e

cslc --arch=wse3 ./layout.csl --fabric-dims=15,5 --fabric-offsets=4,1 \
--params=pes:7,chunk:3,dim:19,run:3 \
--params=MEMCPYH2D_DATA_1_ID:10,MEMCPYD2H_DATA_1_ID:11,MEMCPYD2H_DATA_2_ID:12 -o out --memcpy --channels=1
cs_python run.py --name out

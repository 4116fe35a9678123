#!/usr/bin/env bash
# Rewrites a .cu file ($1) into host-compilable C++ on stdout for the emulator (emu.h): kernel launches
# `k<<<grid, block, smem, stream>>>(args);` become kvk_emu::launch(grid, block, smem, stream, [&]{ k(args); }),
# and the dynamic shared-memory array becomes a per-block buffer.
set -euo pipefail
perl -0pe 's/extern __shared__ (__align__\(16\) )?float smem\[\];/float* smem = kvk_emu::dyn_smem<float>();/g; s/(\w+(?:<[^<>;]*>)?)<<<(.*?)>>>\((.*?)\);/kvk_emu::launch($2, [&]{ $1($3); });/gs' "$1"

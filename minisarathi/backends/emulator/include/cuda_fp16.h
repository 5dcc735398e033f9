// Stub for the CPU emulator: everything lives in minisarathi_emu.h.
#pragma once
#include "minisarathi_emu.h"

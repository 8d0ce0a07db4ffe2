/* bcryptprimitives.c — a stand-in for Windows' bcryptprimitives.dll in the Wine prefix of the
 * Windows step (test/portability/windows.mjs), built there with mingw-w64. A Wine gap, not a kvl
 * one: sharp's libvips imports ProcessPrng from bcryptprimitives.dll, which every Windows 10/11
 * has and Wine 8.0 lacks (the DLL then fails to load: "Could not load the sharp module").
 * ProcessPrng fills a buffer with random bytes and returns TRUE; here it forwards to advapi32's
 * SystemFunction036 (RtlGenRandom), which Wine has. A Wine that has its own bcryptprimitives
 * loads its builtin one first, and this file is never used. */
#include <windows.h>

BOOLEAN WINAPI SystemFunction036(PVOID buffer, ULONG length);

__declspec(dllexport) BOOL WINAPI ProcessPrng(PBYTE data, SIZE_T len) {
    while (len > 0) {
        ULONG n = len > 0x40000000u ? 0x40000000u : (ULONG)len;
        if (!SystemFunction036(data, n)) return FALSE;
        data += n;
        len -= n;
    }
    return TRUE;
}

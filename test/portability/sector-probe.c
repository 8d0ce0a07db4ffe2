/* sector-probe.c — built with mingw-w64 and run under Wine by test/portability/windows.mjs: opens
 * a file as the native core opens a pack's .bin for direct reads (platform.h, FILE_FLAG_NO_BUFFERING)
 * and prints the alignment the core takes from the volume (kvl_os_direct_alignment), and whether
 * FileStorageInfo answered (else the GetDiskFreeSpaceW fallback did):
 *   sector-probe.exe FILE   ->   "alignment N source FileStorageInfo|GetDiskFreeSpaceW|none"
 * Exit status 1 when the file cannot be opened that way. */
#include <stdio.h>

#include "platform.h"

int main(int argc, char **argv) {
    kvl_os_file f = KVL_OS_FILE_INVALID;
    FILE_STORAGE_INFO si;
    uint32_t align;
    int rc;
    if (argc != 2) {
        fprintf(stderr, "usage: sector-probe FILE\n");
        return 2;
    }
    rc = kvl_os_open_read(argv[1], 1, &f);
    if (rc != 0) {
        printf("open failed: error %d\n", rc);
        return 1;
    }
    align = kvl_os_direct_alignment(f, argv[1]);
    /* the same order as kvl_os_direct_alignment: FileStorageInfo when it gives a size */
    printf("alignment %u source %s\n", (unsigned)align,
           GetFileInformationByHandleEx(f, FileStorageInfo, &si, sizeof si) &&
                   (si.LogicalBytesPerSector || si.PhysicalBytesPerSectorForAtomicity)
               ? "FileStorageInfo"
           : align ? "GetDiskFreeSpaceW"
                   : "none");
    kvl_os_close(f);
    return 0;
}

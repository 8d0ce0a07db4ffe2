/* win_delay_load_hook.c — Windows only: lets kvl_core.node load into any executable that holds
 * Node-API, not only one named node.exe. The addon's napi_* imports name "node.exe" (the import
 * library made from node-api-headers' .def files), which the Windows loader matches by file
 * name: inside kvl's single executable (kvl-win-x64.exe, scripts/build-exe.mjs) no module of that
 * name is loaded and the addon failed with "Module not found". Linked with node.exe delay-loaded
 * (mingw-w64: dlltool --output-delaylib; MSVC: /DELAYLOAD:node.exe), the first napi_* call asks
 * this hook, which answers with the process's own executable, which exports them. node-gyp
 * builds every addon the same way (its win_delay_load_hook.cc). Compiled only for Windows
 * (wasm-core/CMakeLists.txt, scripts/check-mingw.sh). */
#include <windows.h>

#include <delayimp.h>
#include <string.h>

static FARPROC WINAPI kvl_load_exe_hook(unsigned event, PDelayLoadInfo info) {
    if (event == dliNotePreLoadLibrary && _stricmp(info->szDll, "node.exe") == 0) {
        return (FARPROC)GetModuleHandleW(NULL);
    }
    return NULL;
}

/* MSVC's delayimp.h declares the hook const, mingw-w64's does not */
#ifdef _MSC_VER
const
#endif
PfnDliHook __pfnDliNotifyHook2 = kvl_load_exe_hook;

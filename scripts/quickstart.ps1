# One command from a fresh Windows machine to a chat (PowerShell 5.1+ or 7):
#   scripts\quickstart.ps1 [-ModelDir DIR]        install kvl, download + pack the pinned model,
#                                                 run the doctor, open an interactive chat
#   scripts\quickstart.ps1 -Demo [-ModelDir DIR]  the same path on a tiny synthesized model
# Needs Node >= 20; with CMake and the "Desktop development with C++" build tools (MSVC) npm ci
# also builds the optional native addon (without them kvl runs on WebAssembly).
param([switch]$Demo, [string]$ModelDir = "")
$ErrorActionPreference = "Stop"
Set-Location (Split-Path -Parent $PSScriptRoot)

if ($ModelDir -eq "") {
    $name = if ($Demo) { "demo-tiny" } else { "kimi-vl-a3b-instruct" }
    $ModelDir = Join-Path $env:LOCALAPPDATA "kvl\$name"
}

function Invoke-Checked([string]$exe, [string[]]$arguments) {
    & $exe @arguments
    if ($LASTEXITCODE -ne 0) { throw "$exe $($arguments -join ' ') failed with exit code $LASTEXITCODE" }
}

Write-Host "== installing kvl: npm ci (TypeScript; the native addon where CMake and a C compiler exist)"
Invoke-Checked "npm" @("ci", "--no-audit", "--no-fund")
Write-Host "== doctor: backends and kernel self-test"
Invoke-Checked "node" @("dist\cli\kvl.js", "doctor")


if ($Demo) {
    $src = "$ModelDir.src"
    if (-not (Test-Path "$src\config.json")) { Invoke-Checked "node" @("dist\cli\kvl.js", "synth", $src, "--preset", "tiny", "--seed", "0") }
    Invoke-Checked "node" @("dist\cli\kvl.js", "pack", $src, $ModelDir, "--allow-revision")
} else {
    Invoke-Checked "node" @("dist\cli\kvl.js", "prepare", $ModelDir)
}
Invoke-Checked "node" @("dist\cli\kvl.js", "doctor", $ModelDir)
Write-Host "== chat (type /quit to leave)"
& node dist\cli\kvl.js chat $ModelDir

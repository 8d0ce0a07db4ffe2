# One command from a fresh Windows machine to a chat (PowerShell 5.1+ or 7): finds Node and runs
# scripts\quickstart.mjs, which does every step, the same on every OS (see its header):
#   scripts\quickstart.ps1 [-ModelDir DIR]        install kvl, download + pack the pinned model,
#                                                 run the doctor, open an interactive chat
#   scripts\quickstart.ps1 -Demo [-ModelDir DIR]  the same path on a tiny synthesized model
# Needs Node >= 20 and nothing else: the native addon comes prebuilt (prebuilds\win32-x64, with
# the AVX2 / AVX-512 kernels chosen for the CPU at start).
param([switch]$Demo, [string]$ModelDir = "")
$node = Get-Command node -ErrorAction SilentlyContinue
if (-not $node) {
    Write-Host "quickstart: Node.js 20 or newer is needed and node is not on PATH (https://nodejs.org/en/download)"
    exit 1
}
$arguments = @(Join-Path $PSScriptRoot "quickstart.mjs")
if ($Demo) { $arguments += "--demo" }
if ($ModelDir -ne "") { $arguments += $ModelDir }
& $node.Source @arguments
exit $LASTEXITCODE

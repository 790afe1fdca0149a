# Build the Windows installer on Windows: dist\switchyard\ (PyInstaller, build.spec) and
# dist\Switchyard-<version>-setup.exe (Inno Setup 6.3+, installers\windows\switchyard.iss).
# Needs Python 3.11+ (python.org or winget) and Inno Setup (winget install JRSoftware.InnoSetup).
# Usage, from the repository root:  powershell -ExecutionPolicy Bypass -File installers\windows\build.ps1
$ErrorActionPreference = "Stop"
Set-Location (Join-Path $PSScriptRoot "..\..")
if (-not (Test-Path .venv\Scripts\python.exe)) { py -3 -m venv .venv }
.venv\Scripts\python.exe -m pip install -q -e ".[build]"
if ($LASTEXITCODE -ne 0) { throw "pip install failed" }
.venv\Scripts\pyinstaller.exe --noconfirm --log-level WARN --workpath build\pyinstaller --distpath dist build.spec
if ($LASTEXITCODE -ne 0) { throw "PyInstaller failed" }
# Sign dist\switchyard\*.exe here (signtool) for distribution; unsigned installers trigger SmartScreen.
$iscc = (Get-Command iscc.exe -ErrorAction SilentlyContinue).Source
if (-not $iscc) { $iscc = Join-Path ${env:ProgramFiles(x86)} "Inno Setup 6\ISCC.exe" }
if (-not (Test-Path $iscc)) { $iscc = Join-Path $env:LOCALAPPDATA "Programs\Inno Setup 6\ISCC.exe" }
& $iscc installers\windows\switchyard.iss
if ($LASTEXITCODE -ne 0) { throw "Inno Setup failed" }
Get-ChildItem dist\Switchyard-*-setup.exe | Select-Object Name, Length

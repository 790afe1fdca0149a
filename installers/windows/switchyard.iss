; Inno Setup script for the Switchyard Windows installer (Inno Setup 6.3+). Build it on Windows with
; installers\windows\build.ps1, which runs PyInstaller (build.spec) first: this script packs dist\switchyard\ and
; takes the version and icon that build.spec writes to build\installer\ from desktop\__init__.py and resources\.
;
; Installs per user (no admin prompt; "install for all users" is offered), adds a Start-menu entry, optionally a
; desktop icon and the `switchyard` command on PATH. The uninstaller first stops the running engines that belong
; to this install (switchyard --uninstall-stop-engines: the same hook as the .deb's prerm and the macOS
; uninstaller), then removes the program files; settings, history, models and engines under %LOCALAPPDATA% stay.

#include "..\..\build\installer\version.iss"
#ifndef AppVersion
  #error Run PyInstaller with build.spec first: it writes build\installer\version.iss
#endif
#define AppName "Switchyard"
#define AppExe "SwitchyardApp.exe"
#define CliExe "switchyard.exe"

[Setup]
AppId={{7D3C8E52-4B1A-4F0E-9C2D-5A6B7E8F9A01}
AppName={#AppName}
AppVersion={#AppVersion}
AppVerName={#AppName} {#AppVersion}
AppPublisher=The Switchyard developers
VersionInfoVersion={#AppVersion}
DefaultDirName={autopf}\{#AppName}
DefaultGroupName={#AppName}
DisableProgramGroupPage=yes
PrivilegesRequired=lowest
PrivilegesRequiredOverridesAllowed=dialog
ArchitecturesAllowed=x64compatible
ArchitecturesInstallIn64BitMode=x64compatible
SetupIconFile=..\..\build\installer\switchyard.ico
UninstallDisplayIcon={app}\{#AppExe}
UninstallDisplayName={#AppName}
OutputDir=..\..\dist
OutputBaseFilename={#AppName}-{#AppVersion}-setup
Compression=lzma2
SolidCompression=yes
WizardStyle=modern
CloseApplications=yes
ChangesEnvironment=yes

[Tasks]
Name: "desktopicon"; Description: "{cm:CreateDesktopIcon}"; GroupDescription: "{cm:AdditionalIcons}"; Flags: unchecked
Name: "addtopath"; Description: "Add the switchyard command to PATH"; GroupDescription: "Command line:"

[Files]
Source: "..\..\dist\switchyard\*"; DestDir: "{app}"; Flags: ignoreversion recursesubdirs createallsubdirs

[Icons]
Name: "{group}\{#AppName}"; Filename: "{app}\{#AppExe}"; IconFilename: "{app}\{#AppExe}"
Name: "{group}\Uninstall {#AppName}"; Filename: "{uninstallexe}"
Name: "{autodesktop}\{#AppName}"; Filename: "{app}\{#AppExe}"; Tasks: desktopicon

[Registry]
Root: HKA; Subkey: "{code:EnvironmentKey}"; ValueType: expandsz; ValueName: "Path"; ValueData: "{olddata};{app}"; Tasks: addtopath; Check: NeedsAddPath(ExpandConstant('{app}'))

[Run]
Filename: "{app}\{#AppExe}"; Description: "{cm:LaunchProgram,{#AppName}}"; Flags: nowait postinstall skipifsilent

[UninstallRun]
; Before any file is removed: stop this install's running engines (see desktop\_frozen.py).
Filename: "{app}\{#CliExe}"; Parameters: "--uninstall-stop-engines"; Flags: runhidden waituntilterminated; RunOnceId: "StopEngines"

[Code]
function EnvironmentKey(Param: String): String;
begin
  if IsAdminInstallMode then
    Result := 'SYSTEM\CurrentControlSet\Control\Session Manager\Environment'
  else
    Result := 'Environment';
end;

function PathRoot: Integer;
begin
  if IsAdminInstallMode then Result := HKEY_LOCAL_MACHINE else Result := HKEY_CURRENT_USER;
end;

function NeedsAddPath(Dir: String): Boolean;
var
  Paths: String;
begin
  if not RegQueryStringValue(PathRoot, EnvironmentKey(''), 'Path', Paths) then
    Paths := '';
  Result := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Paths) + ';') = 0;
end;

procedure CurUninstallStepChanged(CurUninstallStep: TUninstallStep);
var
  Paths, Dir: String;
  P: Integer;
begin
  if CurUninstallStep <> usPostUninstall then
    Exit;
  if not RegQueryStringValue(PathRoot, EnvironmentKey(''), 'Path', Paths) then
    Exit;
  Dir := ExpandConstant('{app}');
  P := Pos(';' + Uppercase(Dir) + ';', ';' + Uppercase(Paths) + ';');
  if P = 0 then
    Exit;
  { Dir starts at index P of Paths: remove "Dir;" there, or ";Dir" when it is last }
  if Length(Paths) = Length(Dir) then
    Paths := ''
  else if P + Length(Dir) > Length(Paths) then
    Delete(Paths, P - 1, Length(Dir) + 1)
  else
    Delete(Paths, P, Length(Dir) + 1);
  RegWriteExpandStringValue(PathRoot, EnvironmentKey(''), 'Path', Paths);
end;

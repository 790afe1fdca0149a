"""The PySide6 desktop app. Qt lives only here; widgets stay thin and call `desktop.core` through workers."""

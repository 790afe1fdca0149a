"""The PySide6 desktop app. Qt lives only here; widgets stay thin and call `desktop.core` through workers.

Threads and Qt objects, the rule:
- Qt objects, and Python objects that own one, are created, used and dropped on the GUI thread only.
- Core work runs on the thread pool (`workers.submit`) or core threads, which get plain data (or the GUI-owned
  callables the GUI keeps alive itself) and hand plain data back through signals of a long-lived GUI-thread object
  or a queue the GUI thread drains. A worker drops its references to the GUI's callables before it reports.
- Python's cyclic garbage collector runs only on the GUI thread (`gc_policy`): automatic collection is off, and a
  GUI timer collects. Charts are built without pyqtgraph's context menus and without lambdas that capture them,
  so they die with their widgets, not by the collector.
"""

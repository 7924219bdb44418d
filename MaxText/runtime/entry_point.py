"""How an entry point runs its main: a `UserError` becomes one line and exit status 2, not a traceback.

Anything else is a bug and keeps its traceback, unless a lost process of a multi-process job caused it (peer_monitor
reports that in one line).
"""

from MaxText.errors import UserError
from MaxText.runtime import peer_monitor


def run_and_exit_on_user_error(main, argv) -> None:
  """Runs an entry point's main(argv); a UserError becomes one line on stderr and exit status 2.

  In a multi-process job, an error that a lost process may have caused waits for peer_monitor's verdict first; an
  error ends the process at once after its line, telling the other processes (peer_monitor.exit_after_error); a main
  that returns tells them that this one ended normally.

  `-h`/`--help` prints the entry point's module docstring (its usage) instead, then, for an entry point that reads
  a config (it imports pyconfig), every config key with its type, default, valid values and help.
  """
  import sys  # pylint: disable=import-outside-toplevel

  if len(argv) > 1 and argv[1] in ("-h", "--help"):
    module = sys.modules[main.__module__]
    print((module.__doc__ or "").strip())
    pyconfig = vars(module).get("pyconfig")
    if pyconfig is None:
      print("\nConfig keys and their defaults: MaxText/configs/base.yml; docs/config.md explains the config system.")
      return
    print()
    pyconfig.exit_with_help_if_asked(argv)
    return
  try:
    main(argv)
  except UserError as e:
    peer_monitor.wait_if_lost(e)
    print(f"Error: {e}", file=sys.stderr, flush=True)
    peer_monitor.exit_after_error(2)
    sys.exit(2)
  except KeyboardInterrupt as e:  # Ctrl-C before the step loop, or a second one in it: where it landed, not a traceback
    print(f"Interrupted (Ctrl-C){_where(e)}", file=sys.stderr, flush=True)
    peer_monitor.exit_after_error(130)
    sys.exit(130)
  except Exception as e:  # a failed collective of a multi-process job: a lost process is reported in one line instead
    peer_monitor.wait_if_lost(e)
    peer_monitor.exit_after_error(1, e)
    raise
  peer_monitor.finished()  # the other processes of the job no longer watch this one


def _where(error: BaseException) -> str:
  """' in <function> (MaxText/<file>:<line>)': the innermost frame of this project that the error passed."""
  import os  # pylint: disable=import-outside-toplevel
  import traceback  # pylint: disable=import-outside-toplevel

  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  ours = [f for f in traceback.extract_tb(error.__traceback__) if f.filename.startswith(root + os.sep)]
  if not ours:
    return ""
  frame = ours[-1]
  return f" in {frame.name} ({os.path.relpath(frame.filename, root)}:{frame.lineno})"

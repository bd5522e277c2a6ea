"""The program :mod:`megarlhf.isolation.sandbox` runs inside the sandbox (its source is passed with ``python -I -c``):
executes the model's program, then each test in the program's namespace, reporting every outcome.

Standard library only: it must not import megarlhf into a process that runs model-written code. Input:
one JSON object on stdin, ``{"token", "program", "files", "tests"}`` (``files``: relative path -> text,
written under the working directory before the program runs), read and closed before the program runs; a
test is ``{"call": "f(2)"}`` (its value is reported, as plain JSON, for the parent to compare with the
expected value it never sent here) or ``{"assert": "assert f(2) == 4"}`` (passes if it raises nothing).
Output: one line ``<token> <json>`` per outcome on the descriptor that was stdout at start; the
program's own output goes to stderr's descriptor. Everything here shares a process with the program, so
it can forge these lines: the parent trusts only the values of call tests, which are wrong unless the
program computes them (module docstring of :mod:`megarlhf.isolation.sandbox`).
"""
import json
import os
import sys

_SHOWN = 300  # characters of an error kept in a report
_PLAIN = (int, float, str, bool, type(None))


def plain(value, depth=0):
    """``value`` as JSON data if it is built of exactly int, float, str, bool, None, list, tuple and dict
    with str keys (no subclasses: an object with its own ``__eq__`` does not pass as a number)."""
    if depth > 100:
        raise TypeError("the value is nested more than 100 deep")
    kind = type(value)
    if kind in _PLAIN:
        return value
    if kind in (list, tuple):
        return [plain(item, depth + 1) for item in value]
    if kind is dict and all(type(key) is str for key in value):
        return {key: plain(item, depth + 1) for key, item in value.items()}
    raise TypeError(f"the call returned a {kind.__name__}, not plain data (numbers, strings, lists, dicts)")


def write_files(files):
    """The request's files (checked by the parent: relative paths) under the working directory, which goes
    first on ``sys.path`` so that the program imports them."""
    root = os.getcwd()
    for path, text in files.items():
        target = os.path.join(root, path)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as f:
            f.write(text)
    sys.path.insert(0, root)


def main(compile=compile, exec=exec, eval=eval, dumps=json.dumps, write=os.write):
    # the builtins are bound here, before the program can replace them
    request = json.loads(sys.stdin.read())
    sys.stdin.close()
    os.close(0)
    channel = os.dup(1)
    os.dup2(2, 1)  # the program's prints go with its errors
    token = request["token"]

    def report(record):
        write(channel, (token + " " + dumps(record) + "\n").encode())

    def error():
        kind, value, _ = sys.exc_info()
        text = f"{kind.__name__}: {value}"
        return text if len(text) <= _SHOWN else text[:_SHOWN] + "..."

    namespace = {"__name__": "__main__"}
    try:
        write_files(request.get("files") or {})
        exec(compile(request["program"], "solution.py", "exec"), namespace)
    except BaseException:  # the program raising, calling sys.exit, ... fails every test
        report({"solution_error": error()})
        return
    for index, test in enumerate(request["tests"]):
        try:
            if "call" in test:
                report({"test": index, "value": plain(eval(compile(test["call"], f"test_{index}", "eval"), namespace))})
            else:
                exec(compile(test["assert"], f"test_{index}", "exec"), namespace)
                report({"test": index, "passed": True})
        except BaseException:
            report({"test": index, "error": error()})
    report({"done": True})


if __name__ == "__main__":
    main()
    # what the program printed is still in its buffers: written now, for the report's output (a stream that
    # fails, e.g. past the file-size limit, or that the program replaced, only loses its own output)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except BaseException:
            pass
    # no interpreter shutdown: the program's atexit hooks would otherwise decide the exit status after its
    # report is complete
    os._exit(0)

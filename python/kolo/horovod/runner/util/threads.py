"""Thread helpers of `horovod.runner.util.threads`."""

import threading


def in_thread(target, args=(), name=None, daemon=True, silent=False):
    """Runs `target(*args)` on a new thread (a daemon by default); the
    thread. `silent`: an exception it raises is not printed."""

    def run():
        try:
            target(*args)
        except BaseException:
            if not silent:
                raise

    thread = threading.Thread(target=run, name=name, daemon=daemon)
    thread.start()
    return thread


def on_event(event, func, args=(), stop=None, check_stop_interval_s=1.0, silent=False):
    """Runs `func(*args)` on a daemon thread once `event` is set, unless
    `stop` is set first; the thread."""

    def wait():
        while not event.wait(check_stop_interval_s):
            if stop is not None and stop.is_set():
                return
        if stop is None or not stop.is_set():
            func(*args)

    return in_thread(wait, silent=silent)


def execute_function_multithreaded(fn, args_list, block_until_all_done=True, max_concurrent_executions=1000):
    """`fn(*args)` for each of `args_list` on up to `max_concurrent_executions`
    threads; with `block_until_all_done`, the results by index."""
    results = {}
    semaphore = threading.BoundedSemaphore(max(1, max_concurrent_executions))

    def call(i, args):
        with semaphore:
            results[i] = fn(*args)

    threads = [in_thread(call, (i, args)) for i, args in enumerate(args_list)]
    if block_until_all_done:
        for t in threads:
            t.join()
        return results
    return None

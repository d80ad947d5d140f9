"""submit() / wait(): run an operator's forward on a worker thread so the caller can overlap
other work. The kernels release the GIL, so the caller really runs meanwhile."""
import concurrent.futures


class SubmitWait:
    _pool = None
    _future = None

    def submit(self, hidden, topk_ids, topk_weights) -> None:
        if self._future is not None:
            raise RuntimeError("submit() called twice without wait()")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="moe")
        self._future = self._pool.submit(self.forward, hidden, topk_ids, topk_weights)

    def wait(self):
        if self._future is None:
            raise RuntimeError("wait() without submit()")
        fut, self._future = self._future, None
        return fut.result()

// TensorFlow's C API hands an async kernel its done callback as a pointer
// to a std::function that lives only while compute_async runs (it is a
// by-value parameter of CAsyncOpKernel::ComputeAsync). These two functions
// move it to the heap so that kolo's core can run it when the collective
// completes, and need no TensorFlow header.
#include <functional>
#include <utility>

extern "C" void* kolo_tf_take_done(void* done) {
  return new std::function<void()>(std::move(*static_cast<std::function<void()>*>(done)));
}

extern "C" void kolo_tf_run_done(void* taken) {
  auto* done = static_cast<std::function<void()>*>(taken);
  (*done)();
  delete done;
}

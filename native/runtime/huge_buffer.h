// Weight storage: anonymous memory rounded to 2 MiB and advised for transparent huge pages, so
// streaming gigabytes of expert weights does not pay a TLB miss every 4 KiB.
#pragma once
#include <sys/mman.h>

#include <cstddef>
#include <new>

namespace moe {

class HugeBuffer {
 public:
  explicit HugeBuffer(size_t n) : size_(n), mapped_((n + (2u << 20) - 1) & ~size_t((2u << 20) - 1)) {
    if (mapped_ == 0) mapped_ = 2u << 20;
    void* p = mmap(nullptr, mapped_, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    madvise(p, mapped_, MADV_HUGEPAGE);  // best effort: fine if THP is off
    ptr_ = static_cast<char*>(p);
  }
  ~HugeBuffer() { munmap(ptr_, mapped_); }
  HugeBuffer(const HugeBuffer&) = delete;
  HugeBuffer& operator=(const HugeBuffer&) = delete;
  char* data() const { return ptr_; }
  size_t size() const { return size_; }

 private:
  size_t size_, mapped_;
  char* ptr_ = nullptr;
};

}  // namespace moe

// Physical KV blocks: reference counts, a free list and an LRU list of evictable cached blocks.
// Every block is in exactly one state: free (on the free list), in use (refcount > 0) or
// evictable (refcount 0, still holding prefix-cached content, on the LRU list). All O(1).
#pragma once

#include <cassert>
#include <cstdint>
#include <vector>

namespace pagedinfer {

class BlockPool {
 public:
  explicit BlockPool(int32_t num_blocks);

  int32_t num_blocks() const { return static_cast<int32_t>(refcount_.size()); }
  int32_t num_free() const { return static_cast<int32_t>(free_list_.size()); }
  int32_t num_evictable() const { return num_lru_; }
  int32_t num_available() const { return num_free() + num_evictable(); }
  int32_t refcount(int32_t block) const { return refcount_[block]; }
  bool is_evictable(int32_t block) const { return in_lru_[block] != 0; }

  // Free list -> in use (refcount 1). Requires num_free() > 0. Lowest ids come first.
  int32_t pop_free() {
    assert(!free_list_.empty());
    int32_t block = free_list_.back();
    free_list_.pop_back();
    refcount_[block] = 1;
    return block;
  }
  // Least recently used evictable block -> in use (refcount 1). Requires num_evictable() > 0.
  int32_t pop_lru() {
    int32_t block = lru_head_;
    assert(block >= 0);
    unlink(block);
    refcount_[block] = 1;
    return block;
  }
  // One more reference; an evictable block leaves the LRU list.
  void incref(int32_t block) {
    if (refcount_[block] == 0) unlink(block);
    ++refcount_[block];
  }
  // One reference less; returns the new count. At 0 the caller files the block with
  // push_free() or push_lru() depending on whether it still holds cached content.
  int32_t decref(int32_t block) {
    assert(refcount_[block] > 0);
    return --refcount_[block];
  }
  void push_free(int32_t block) {
    assert(refcount_[block] == 0 && !in_lru_[block]);
    free_list_.push_back(block);
  }
  // Appends at the most recently used end.
  void push_lru(int32_t block);
  // Evictable -> free (its cached content was dropped).
  void evictable_to_free(int32_t block) {
    unlink(block);
    push_free(block);
  }

  const std::vector<int32_t>& free_list() const { return free_list_; }
  // Evictable blocks from least to most recently used.
  std::vector<int32_t> lru_order() const;

 private:
  void unlink(int32_t block);

  std::vector<int32_t> refcount_;
  std::vector<int32_t> free_list_;  // a stack: back() is taken next
  std::vector<int32_t> lru_prev_;
  std::vector<int32_t> lru_next_;
  std::vector<uint8_t> in_lru_;
  int32_t lru_head_ = -1;  // least recently used
  int32_t lru_tail_ = -1;  // most recently used
  int32_t num_lru_ = 0;
};

}  // namespace pagedinfer

// Hash index of prefix-cached blocks. A full, computed block is identified by a chained 64-bit
// hash of (hash of the previous block, its token ids). The hash is only an index: a lookup is a
// hit only if the stored token ids are equal and the parent is the very same registration of the
// previous block (parent id + generation), so a collision never serves wrong content.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace pagedinfer {

// Hash of a block chain's virtual root (the parent of every first block).
inline constexpr uint64_t kRootHash = 0x243F6A8885A308D3ULL;

uint64_t chain_hash(uint64_t parent_hash, const int32_t* tokens, int32_t num_tokens);

class PrefixCache {
 public:
  explicit PrefixCache(int32_t num_blocks);

  bool is_registered(int32_t block) const { return registered_[block] != 0; }
  uint64_t hash(int32_t block) const { return hash_[block]; }
  int32_t parent(int32_t block) const { return parent_[block]; }
  int32_t size() const { return size_; }

  // The registered block with this hash, or -1.
  int32_t find(uint64_t hash) const;
  // True if `block` (registered) was registered as the child of the current registration of
  // `parent` (-1: the root).
  bool is_child_of(int32_t block, int32_t parent) const;
  // True if the registration `block` hangs from still exists (its parent was not modified or
  // evicted since). Only such blocks can be reached by a lookup from the root.
  bool has_valid_parent(int32_t block) const;

  // Registers `block` (not registered) under `hash` (not present) as the child of `parent`.
  void insert(int32_t block, uint64_t hash, int32_t parent);
  // Removes the registration of `block` (registered).
  void erase(int32_t block);

 private:
  std::size_t slot_of(uint64_t hash) const { return static_cast<std::size_t>(hash) & mask_; }

  struct Entry {
    uint64_t hash;
    int32_t block;  // -1: empty
  };
  std::vector<Entry> table_;  // open addressing, linear probing (hash inline: one cache line)
  std::size_t mask_ = 0;
  std::vector<uint64_t> hash_;
  std::vector<int32_t> parent_;
  std::vector<uint64_t> parent_generation_;
  std::vector<uint64_t> generation_;  // fresh for every registration
  std::vector<uint8_t> registered_;
  uint64_t next_generation_ = 1;
  int32_t size_ = 0;
};

}  // namespace pagedinfer

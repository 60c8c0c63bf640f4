// The single source of truth for which physical KV block holds which tokens of which sequence.
// Device-agnostic: deals only in block ids and slots (slot = block_id * block_size + offset); the
// K/V tensors live elsewhere and every tensor-parallel rank reads the same tables.
//
// Not thread-safe: callers serialise access (the Python binding holds a mutex).
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

#include "pagedinfer/block_pool.h"
#include "pagedinfer/errors.h"
#include "pagedinfer/prefix_cache.h"

namespace pagedinfer {

// A block copy the model runner must perform on the device before writing into `dst`.
struct BlockCopy {
  int32_t src;
  int32_t dst;
  bool operator==(const BlockCopy& other) const { return src == other.src && dst == other.dst; }
};

struct Sequence {
  std::vector<int32_t> tokens;
  std::vector<int32_t> blocks;  // page table: logical block -> physical block
  // Leading blocks already offered to the prefix cache (registered or deduplicated).
  int32_t num_hashed_blocks = 0;
  // The last batch call that visited it (duplicate-id detection): bookkeeping, not state, so
  // const batch queries may stamp it too (not thread-safe: the binding serialises every call).
  mutable uint64_t batch_stamp = 0;
};

struct BlockManagerStats {
  int32_t total_blocks = 0;
  int32_t free_blocks = 0;           // on the free list (no cached content)
  int32_t used_blocks = 0;           // refcount > 0
  int32_t cached_blocks = 0;         // refcount 0, prefix-cached, evictable
  int64_t stored_tokens = 0;         // distinct token slots holding live data in used blocks
  int64_t prefix_cache_hits = 0;     // tokens served from cached blocks by add_sequence
  int64_t prefix_cache_queries = 0;  // tokens looked up by add_sequence
  int64_t cow_copies = 0;
  int64_t evictions = 0;
  int64_t num_sequences = 0;
};

// An int32 buffer left uninitialised (every element is written by build_batch).
struct Int32Buffer {
  std::unique_ptr<int32_t[]> data;
  int64_t size = 0;
  explicit Int32Buffer(int64_t n) : data(new int32_t[n > 0 ? n : 1]), size(n) {}
};

// Inputs of one engine step, all for the whole batch.
struct BatchArrays {
  int64_t batch = 0;
  int64_t max_blocks = 0;
  Int32Buffer block_tables;     // [batch, max_blocks], padding 0
  Int32Buffer slot_mapping;     // [num_new_tokens]
  Int32Buffer positions;        // [num_new_tokens]
  Int32Buffer context_lens;     // [batch]
  Int32Buffer query_start_loc;  // [batch + 1]
  BatchArrays(int64_t batch, int64_t max_blocks, int64_t num_new_tokens);
};

class BlockManager {
 public:
  BlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching);

  // Registers a sequence and allocates blocks for all its tokens, reusing the longest run of
  // computed prefix-cached full blocks. Returns the number of tokens those reused blocks hold.
  int64_t add_sequence(int64_t seq_id, const int32_t* tokens, int64_t num_tokens);
  // Appends tokens. Only the partly filled last block can be shared and written, so there is at
  // most one copy-on-write, returned for the model runner to perform first.
  std::optional<BlockCopy> append_tokens(int64_t seq_id, const int32_t* tokens, int64_t num_tokens);
  // append_tokens for a whole step in one call: token_ids holds each sequence's tokens in turn
  // (num_tokens[i] of them). All or nothing; the ids must be distinct. Returns every copy.
  std::vector<BlockCopy> append_tokens_batch(const int64_t* seq_ids, const int32_t* num_tokens,
                                             int64_t batch, const int32_t* token_ids,
                                             int64_t num_token_ids);
  // Replaces the last token of each sequence (a placeholder appended before its id was known:
  // asynchronous scheduling). Its block must be exclusively owned and not yet offered to the
  // prefix cache. All or nothing; the ids must be distinct.
  void set_last_tokens(const int64_t* seq_ids, const int32_t* tokens, int64_t batch);
  // Overwrites the recorded ids at positions [start, start + num_tokens) in place: placeholders of
  // an asynchronous step whose real ids arrived later. Never allocates or moves a block (an
  // in-flight step writes K/V through the current table); every touched block must be exclusively
  // owned and not yet offered to the prefix cache. Validates everything before changing anything.
  void set_tokens(int64_t seq_id, int64_t start, const int32_t* tokens, int64_t num_tokens);
  // Exact number of blocks append_tokens would take (new blocks plus a copy-on-write block).
  int64_t blocks_needed_to_append(int64_t seq_id, int64_t num_tokens) const;
  // Exact number of blocks append_tokens_batch would take for these counts (ids distinct): of k
  // appending holders of one shared last block, fewer than k may copy it.
  int64_t blocks_needed_to_append_batch(const int64_t* seq_ids, const int32_t* num_tokens,
                                        int64_t batch) const;
  // The child shares every block of the parent (copy-on-write on the next divergent append).
  void fork(int64_t parent_id, int64_t child_id);
  // Keeps the first num_tokens tokens, releasing whole blocks past them. Copy-on-write of a now
  // partly filled shared block is deferred to the next append, so nothing is copied here.
  void truncate(int64_t seq_id, int64_t num_tokens);
  void free(int64_t seq_id);
  // K/V of the first num_computed[i] tokens of seq_ids[i] is on the device: their full blocks
  // become reusable by later add_sequence calls. Validates everything before changing anything.
  void mark_computed(const int64_t* seq_ids, const int32_t* num_computed, int64_t batch);
  // Builds block tables, slot mapping, positions and lengths for one step in one pass.
  // max_blocks < 0: the smallest width that fits the batch.
  BatchArrays build_batch(const int64_t* seq_ids, const int32_t* num_computed,
                          const int32_t* num_new, int64_t batch, int64_t max_blocks) const;

  bool can_allocate(int64_t num_tokens) const;
  bool has_sequence(int64_t seq_id) const { return seqs_.count(seq_id) != 0; }
  const Sequence& sequence(int64_t seq_id) const;
  int32_t block_refcount(int32_t block) const;
  // The block_size token ids stored in a block (slots past its fill hold stale values).
  const int32_t* block_tokens(int32_t block) const;

  BlockManagerStats stats() const;
  // Throws InvariantError describing the first inconsistency found. O(everything).
  void check_invariants() const;

  int32_t block_size() const { return block_size_; }
  int32_t num_total_blocks() const { return pool_.num_blocks(); }
  int32_t num_free_blocks() const { return pool_.num_available(); }  // free + evictable
  bool enable_prefix_caching() const { return enable_prefix_caching_; }

 private:
  Sequence& get(int64_t seq_id);
  // New blocks plus copy-on-write copies for appending num_tokens[i] tokens to seqs[i].
  int64_t batch_append_need(const Sequence* const* seqs, const int32_t* num_tokens,
                            int64_t batch) const;
  // Division by the block size, a shift for the usual powers of two (a 64-bit divide costs tens
  // of cycles, several times per appended sequence). Arguments are never negative.
  int64_t block_of(int64_t pos) const { return shift_ >= 0 ? pos >> shift_ : pos / block_size_; }
  int64_t offset_in_block(int64_t pos) const {
    return shift_ >= 0 ? pos & (block_size_ - 1) : pos % block_size_;
  }
  int64_t blocks_for(int64_t num_tokens) const { return block_of(num_tokens + block_size_ - 1); }
  int64_t append_need(const Sequence& seq, int64_t num_tokens) const;
  // A batch's sequences in order; throws on an unknown id or one that appears twice.
  std::vector<const Sequence*> distinct_sequences(const int64_t* seq_ids, int64_t batch) const;
  std::vector<Sequence*> distinct_sequences(const int64_t* seq_ids, int64_t batch);
  void reserve_append(Sequence* seq, int64_t num_tokens);
  void write_tokens(Sequence* seq, int64_t start, const int32_t* tokens,
                    int64_t num_tokens) noexcept;
  std::optional<BlockCopy> append_unchecked(Sequence* seq, const int32_t* tokens,
                                            int64_t num_tokens) noexcept;
  void require_blocks(int64_t needed, const char* what) const;
  int32_t allocate_block();
  void release_block(int32_t block);
  void match_prefix(const int32_t* tokens, int64_t num_tokens, std::vector<int32_t>* out) const;
  bool same_tokens(int32_t block, const int32_t* tokens) const;
  void cache_full_blocks(Sequence* seq, int64_t num_computed);
  void check_blocks() const;
  void check_sequences() const;

  int32_t block_size_;
  int32_t shift_;  // log2(block_size_) for a power of two, else -1
  bool enable_prefix_caching_;
  BlockPool pool_;
  PrefixCache cache_;
  std::vector<int32_t> block_tokens_;  // [num_blocks * block_size]
  std::unordered_map<int64_t, Sequence> seqs_;
  int64_t prefix_cache_hits_ = 0;
  int64_t prefix_cache_queries_ = 0;
  int64_t cow_copies_ = 0;
  int64_t evictions_ = 0;
  mutable uint64_t batch_stamp_ = 0;  // (see Sequence::batch_stamp)
};

}  // namespace pagedinfer

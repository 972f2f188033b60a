//! The response cache (upstream's `response_cache.cc`): once a name has
//! been negotiated, every rank keeps its response under a bit number that
//! means the same on every rank (they all put and get in the same order),
//! so that later cycles agree on what is ready with one small allreduce of
//! bits instead of a gather to the coordinator and a broadcast back.

use std::collections::{BTreeSet, HashMap};

use crate::message::{DataType, Request, Response, ResponseType};

/// What a rank's own tensor looked like when its response was cached.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorParams {
    /// Its device (`CPU_DEVICE_ID` or a GPU's index).
    pub device: i32,
    /// Its element type.
    pub dtype: DataType,
    /// Its dimensions.
    pub shape: Vec<i64>,
}

/// Whether a request can use a cached response.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheState {
    /// The name is not cached.
    Miss,
    /// The name is cached with the same parameters: the response can be reused.
    Hit,
    /// The name is cached with other parameters: the entry must go.
    Invalid,
}

#[derive(Clone, Debug)]
struct Entry {
    response: Response,
    params: TensorParams,
    /// Larger: used more recently.
    used: u64,
}

/// One process set's cache.
#[derive(Debug, Default)]
pub struct ResponseCache {
    capacity: usize,
    /// By bit; `None` where an entry was erased until bits are renumbered.
    entries: Vec<Option<Entry>>,
    by_name: HashMap<String, u32>,
    clock: u64,
    bits_outdated: bool,
    warned: bool,
}

/// Putting a response whose name is cached with other parameters: they
/// must be erased first (upstream's logic_error; a bug, never input).
#[derive(Debug, thiserror::Error)]
#[error("trying to overwrite the cached response of {0} with another")]
pub struct Overwrite(pub String);

impl ResponseCache {
    /// `HOROVOD_CACHE_CAPACITY` (0: off).
    pub fn new(capacity: usize) -> ResponseCache {
        ResponseCache { capacity, ..Default::default() }
    }

    /// Most entries kept (0: the cache is off).
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bits in use: the length of the cycle's bit vector after the status bits.
    pub fn num_active_bits(&self) -> usize {
        self.entries.len()
    }

    /// Names cached now.
    pub fn len(&self) -> usize {
        self.by_name.len()
    }

    /// Whether nothing is cached.
    pub fn is_empty(&self) -> bool {
        self.by_name.is_empty()
    }

    fn entry(&self, bit: u32) -> &Entry {
        self.entries[bit as usize].as_ref().expect("a live cache bit")
    }

    fn touch(&mut self, bit: u32) {
        self.clock += 1;
        let clock = self.clock;
        if let Some(e) = self.entries[bit as usize].as_mut() {
            e.used = clock;
        }
    }

    /// Whether a request's response is cached, as it is.
    pub fn cached(&self, request: &Request) -> CacheState {
        let Some(&bit) = self.by_name.get(&request.name) else { return CacheState::Miss };
        let e = self.entry(bit);
        let same = e.params.device == request.device
            && e.params.dtype == request.dtype
            && e.params.shape == request.shape
            && e.response.prescale == request.prescale
            && e.response.postscale == request.postscale
            && e.response.reduce_op == request.reduce_op
            && e.response.kind == ResponseType::of(request.kind);
        if same {
            CacheState::Hit
        } else {
            CacheState::Invalid
        }
    }

    fn cached_response(&self, response: &Response, params: &TensorParams, joined: bool) -> CacheState {
        let Some(&bit) = self.by_name.get(&response.names[0]) else { return CacheState::Miss };
        let e = self.entry(bit);
        // a joined rank knows only how many elements the others reduce
        let same_shape = match joined {
            true => e.params.shape.iter().product::<i64>() == params.shape.iter().product::<i64>(),
            false => e.params.shape == params.shape,
        };
        let same = e.params.device == params.device
            && e.params.dtype == params.dtype
            && same_shape
            && e.response.prescale == response.prescale
            && e.response.postscale == response.postscale
            && e.response.reduce_op == response.reduce_op
            && e.response.kind == response.kind;
        if same {
            CacheState::Hit
        } else {
            CacheState::Invalid
        }
    }

    /// The bit of a cached name.
    pub fn bit_of(&self, name: &str) -> Option<u32> {
        self.by_name.get(name).copied()
    }

    /// Caches a single-name response; `Ok(Some(warning))` the first time an
    /// entry is evicted (upstream's one warning).
    fn put_one(&mut self, response: Response, params: TensorParams, joined: bool) -> Result<Option<String>, Overwrite> {
        let name = response.names[0].clone();
        let mut warning = None;
        let bit = match self.cached_response(&response, &params, joined) {
            CacheState::Invalid => return Err(Overwrite(name)),
            // the entry as it was, now the most recently used
            CacheState::Hit => self.by_name[&name],
            CacheState::Miss if self.by_name.len() == self.capacity => {
                if !self.warned {
                    self.warned = true;
                    warning = Some(format!(
                        "A response has been evicted from cache which may indicate reduced performance. Better \
                         performance may be obtained by disabling caching (HOROVOD_CACHE_CAPACITY=0) or increasing \
                         the cache capacity (HOROVOD_CACHE_CAPACITY>{}).",
                        self.capacity
                    ));
                }
                // the least recently used makes room; its bit goes to the new one
                let (bit, old) = self
                    .entries
                    .iter()
                    .enumerate()
                    .filter_map(|(b, e)| e.as_ref().map(|e| (b as u32, e)))
                    .min_by_key(|(_, e)| e.used)
                    .map(|(b, e)| (b, e.response.names[0].clone()))
                    .expect("a full cache has entries");
                self.by_name.remove(&old);
                self.entries[bit as usize] = Some(Entry { response, params, used: 0 });
                bit
            }
            CacheState::Miss => {
                let bit = self.entries.len() as u32;
                self.entries.push(Some(Entry { response, params, used: 0 }));
                bit
            }
        };
        self.by_name.insert(name, bit);
        self.touch(bit);
        Ok(warning)
    }

    /// Caches a response as every rank does once the cycle's list is known
    /// (one entry per tensor of a fused response); `params_of(i)` is this
    /// rank's own tensor `i`. Nothing with capacity 0.
    pub fn put(
        &mut self,
        response: &Response,
        params_of: impl Fn(usize) -> TensorParams,
        joined: bool,
    ) -> Result<Option<String>, Overwrite> {
        if self.capacity == 0 {
            return Ok(None);
        }
        let per_tensor = response.sizes.len() / response.names.len().max(1);
        let mut warning = None;
        for (i, name) in response.names.iter().enumerate() {
            let mut single = response.clone();
            single.names = vec![name.clone()];
            single.sizes = response.sizes[i * per_tensor..(i + 1) * per_tensor].to_vec();
            if let Some(w) = self.put_one(single, params_of(i), joined)? {
                warning = Some(w);
            }
        }
        Ok(warning)
    }

    /// The cached response of `bit`, now the most recently used.
    pub fn get(&mut self, bit: u32) -> Response {
        self.touch(bit);
        self.entry(bit).response.clone()
    }

    /// The cached response of `bit`, leaving the order as it is.
    pub fn peek(&self, bit: u32) -> &Response {
        &self.entry(bit).response
    }

    /// The bits of every cached name, in increasing order.
    pub fn all_bits(&self) -> Vec<u32> {
        let mut bits: Vec<u32> = self.by_name.values().copied().collect();
        bits.sort_unstable();
        bits
    }

    /// Drops the entry of `bit` (nothing if it is gone already); bits are
    /// renumbered at the next [`update_bits`](Self::update_bits).
    pub fn erase(&mut self, bit: u32) {
        if let Some(e) = self.entries[bit as usize].take() {
            self.by_name.remove(&e.response.names[0]);
            self.bits_outdated = true;
        }
    }

    /// After erasing, renumbers the bits: the least recently used lowest.
    pub fn update_bits(&mut self) {
        if !self.bits_outdated {
            return;
        }
        let mut live: Vec<Entry> = self.entries.drain(..).flatten().collect();
        live.sort_by_key(|e| e.used);
        self.by_name.clear();
        for (bit, e) in live.into_iter().enumerate() {
            self.by_name.insert(e.response.names[0].clone(), bit as u32);
            self.entries.push(Some(e));
        }
        self.bits_outdated = false;
    }
}

/// One rank's part of a cycle's cache coordination (upstream's
/// `CacheCoordinator`): status and hits as a byte a bit, so that an
/// allreduce with `min` is the bitwise AND of every rank's vector and one
/// with `max` (of the invalid bits) the OR.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CacheCoordinator {
    num_bits: usize,
    /// Bits of this rank's requests that hit the cache (after the AND: the
    /// bits every rank hit).
    pub hits: BTreeSet<u32>,
    /// Bits whose entries must be erased on every rank (cached with other
    /// parameters, stalled, or not runnable beside a join).
    pub invalid: BTreeSet<u32>,
    /// This rank has requests the cache cannot answer, so the cycle must
    /// negotiate (after the AND: some rank has).
    pub uncached: bool,
    /// Work in flight on this rank (after the AND: on any rank of the set).
    pub busy: bool,
}

/// Status bytes in front of the hit bits.
const STATUS: usize = 3;

impl CacheCoordinator {
    /// Nothing set yet, for a cache with `num_bits` bits in use.
    pub fn new(num_bits: usize) -> Self {
        CacheCoordinator { num_bits, ..Default::default() }
    }

    /// Whether this rank has entries to erase.
    pub fn invalid_in_queue(&self) -> bool {
        !self.invalid.is_empty()
    }

    /// This rank's vector for the AND: each status byte 1 when its
    /// condition is false, then 1 per hit.
    pub fn and_vector(&self) -> Vec<u8> {
        let mut v = vec![0u8; STATUS + self.num_bits];
        v[0] = u8::from(!self.uncached);
        v[1] = u8::from(!self.invalid_in_queue());
        v[2] = u8::from(!self.busy);
        for &bit in &self.hits {
            v[STATUS + bit as usize] = 1;
        }
        v
    }

    /// After the AND: what holds for the set (any rank has uncached
    /// requests, which a rank that shuts down counts as, has invalid ones,
    /// has work in flight) and the common hits.
    pub fn take_and(&mut self, v: &[u8]) {
        self.uncached = v[0] == 0;
        let any_invalid = v[1] == 0;
        self.busy = v[2] == 0;
        self.hits = (0..self.num_bits as u32).filter(|&b| v[STATUS + b as usize] == 1).collect();
        if !any_invalid {
            self.invalid.clear();
        }
    }

    /// Whether the OR of invalid bits is needed (some rank has one).
    pub fn needs_or(&self, v_and: &[u8]) -> bool {
        v_and[1] == 0
    }

    /// This rank's vector for the OR: 1 per bit to erase.
    pub fn or_vector(&self) -> Vec<u8> {
        let mut v = vec![0u8; self.num_bits];
        for &bit in &self.invalid {
            v[bit as usize] = 1;
        }
        v
    }

    /// After the OR: every rank erases these entries.
    pub fn take_or(&mut self, v: &[u8]) {
        self.invalid = (0..self.num_bits as u32).filter(|&b| v[b as usize] == 1).collect();
        // a hit no longer cached is not one
        self.hits.retain(|b| !self.invalid.contains(b));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::message::{RequestType, CPU_DEVICE_ID};

    fn response(name: &str, elements: i64) -> Response {
        let mut r = Response::new(ResponseType::Allreduce, name);
        r.sizes = vec![elements];
        r.dtype = DataType::Float32;
        r.devices = vec![CPU_DEVICE_ID; 2];
        r
    }

    fn params(elements: i64) -> TensorParams {
        TensorParams { device: CPU_DEVICE_ID, dtype: DataType::Float32, shape: vec![elements] }
    }

    fn request(name: &str, elements: i64) -> Request {
        Request::new(0, RequestType::Allreduce, DataType::Float32, name, vec![elements])
    }

    #[test]
    fn hits_need_every_parameter_equal_and_anything_else_invalidates() {
        let mut c = ResponseCache::new(4);
        assert_eq!(c.cached(&request("a", 3)), CacheState::Miss);
        c.put(&response("a", 3), |_| params(3), false).unwrap();
        assert_eq!(c.cached(&request("a", 3)), CacheState::Hit);
        assert_eq!(c.cached(&request("a", 4)), CacheState::Invalid);
        let mut scaled = request("a", 3);
        scaled.postscale = 0.5;
        assert_eq!(c.cached(&scaled), CacheState::Invalid);
        let mut gathered = request("a", 3);
        gathered.kind = RequestType::Allgather;
        assert_eq!(c.cached(&gathered), CacheState::Invalid);
        assert!(c.put(&response("a", 5), |_| params(5), false).is_err(), "an invalid entry is never overwritten");
    }

    #[test]
    fn a_full_cache_evicts_the_least_recently_used_and_its_bit_goes_to_the_new_name_warning_once() {
        let mut c = ResponseCache::new(2);
        c.put(&response("a", 1), |_| params(1), false).unwrap();
        c.put(&response("b", 1), |_| params(1), false).unwrap();
        assert_eq!((c.bit_of("a"), c.bit_of("b")), (Some(0), Some(1)));
        c.get(0); // a used: b is now the least recent
        let warning = c.put(&response("c", 1), |_| params(1), false).unwrap().expect("the first eviction warns");
        assert!(warning.contains("HOROVOD_CACHE_CAPACITY>2"), "{warning}");
        assert_eq!((c.bit_of("b"), c.bit_of("c")), (None, Some(1)));
        assert_eq!(c.put(&response("d", 1), |_| params(1), false).unwrap(), None, "one warning only");
        assert_eq!((c.bit_of("a"), c.bit_of("d")), (None, Some(0)));
    }

    #[test]
    fn erased_bits_are_renumbered_least_recently_used_first() {
        let mut c = ResponseCache::new(8);
        for name in ["a", "b", "c", "d"] {
            c.put(&response(name, 1), |_| params(1), false).unwrap();
        }
        c.get(c.bit_of("a").unwrap());
        c.erase(c.bit_of("b").unwrap());
        assert_eq!(c.num_active_bits(), 4, "bits keep their places until renumbered");
        c.update_bits();
        assert_eq!(c.num_active_bits(), 3);
        assert_eq!((c.bit_of("c"), c.bit_of("d"), c.bit_of("a")), (Some(0), Some(1), Some(2)));
        assert_eq!(c.peek(2).names, ["a"]);
    }

    #[test]
    fn fused_responses_are_cached_a_tensor_each() {
        let mut c = ResponseCache::new(8);
        let mut fused = response("x", 3);
        fused.names.push("y".into());
        fused.sizes.push(5);
        c.put(&fused, |i| params([3, 5][i]), false).unwrap();
        assert_eq!(c.peek(c.bit_of("y").unwrap()).sizes, vec![5]);
        assert_eq!(c.cached(&request("x", 3)), CacheState::Hit);
        // a joined rank matches on the element count only
        let reshaped = TensorParams { shape: vec![1, 5], ..params(5) };
        assert!(c.put(&response("y", 5), |_| reshaped.clone(), true).is_ok());
        assert!(c.put(&response("y", 5), |_| reshaped.clone(), false).is_err());
    }

    #[test]
    fn coordination_vectors_and_to_common_hits_and_or_to_invalid_bits() {
        let mut a = CacheCoordinator::new(4);
        a.hits = [0, 1, 3].into();
        let mut b = CacheCoordinator::new(4);
        b.hits = [1, 3].into();
        b.uncached = true;
        b.invalid = [2].into();
        let and: Vec<u8> = a.and_vector().iter().zip(b.and_vector()).map(|(x, y)| (*x).min(y)).collect();
        for c in [&mut a, &mut b] {
            c.take_and(&and);
            assert!(c.uncached);
            assert_eq!(c.hits, [1, 3].into());
        }
        assert!(a.needs_or(&and));
        let or: Vec<u8> = a.or_vector().iter().zip(b.or_vector()).map(|(x, y)| (*x).max(y)).collect();
        a.take_or(&or);
        assert_eq!(a.invalid, [2].into());
    }
}

//! Batched map writes and reads: `bpf(BPF_MAP_UPDATE_BATCH)`,
//! `bpf(BPF_MAP_DELETE_BATCH)` and `bpf(BPF_MAP_LOOKUP_BATCH)`, which aya
//! 0.14 does not wrap.
//!
//! One syscall writes a whole chunk of entries instead of one syscall per
//! entry. On 6.18 the kernel implements both commands for hash, LRU hash,
//! per-CPU hash, LRU per-CPU hash and LPM trie maps, and the update for
//! array and per-CPU array maps (arrays have no delete). Other map types
//! (devmap, bloom filter, ...) answer `ENOTSUPP`; the kernel's batch update
//! also refuses `BPF_NOEXIST`/`BPF_EXIST` in `elem_flags` with `EINVAL`
//! (only `BPF_F_LOCK` is allowed there). In both cases, before any entry is
//! touched, these functions fall back to one `BPF_MAP_UPDATE_ELEM` (or
//! `BPF_MAP_DELETE_ELEM`) per entry, so callers can use them for any map
//! and any flags.
//!
//! Entries are processed in order; on an error, every entry before the
//! failing one has been written and none after it (`BatchError::Entry`
//! names the failing one).

use std::{
    io,
    mem::{offset_of, size_of},
    os::fd::{AsFd as _, AsRawFd as _, BorrowedFd},
    ptr,
};

use aya::{
    Pod,
    maps::{MapData, MapError, MapType},
};

/// `enum bpf_cmd` values (include/uapi/linux/bpf.h).
const BPF_MAP_UPDATE_ELEM: libc::c_int = 2;
const BPF_MAP_DELETE_ELEM: libc::c_int = 3;
const BPF_MAP_LOOKUP_BATCH: libc::c_int = 24;
const BPF_MAP_UPDATE_BATCH: libc::c_int = 26;
const BPF_MAP_DELETE_BATCH: libc::c_int = 27;

/// The kernel-internal "operation not supported" (include/linux/errno.h),
/// what `bpf(2)` returns for a batch command the map type lacks; not the
/// same number as `EOPNOTSUPP`.
const ENOTSUPP: i32 = 524;

/// Per-element flags of `BPF_MAP_UPDATE_ELEM` (and, for the batch, of
/// `elem_flags`, where 6.18 accepts only `BPF_ANY` and `BPF_F_LOCK`).
pub const BPF_ANY: u64 = 0;
pub const BPF_NOEXIST: u64 = 1;
pub const BPF_EXIST: u64 = 2;
pub const BPF_F_LOCK: u64 = 4;

/// Bytes of keys plus values per syscall; bounds the staging buffers.
const CHUNK_BYTES: usize = 1 << 20;
/// A batch lookup's first call: a few hundred entries.
const FIRST_CHUNK_BYTES: usize = 16 << 10;

/// `union bpf_attr`'s `batch` member (the `BPF_MAP_*_BATCH` commands).
#[repr(C, align(8))]
#[derive(Debug, Default)]
struct BatchAttr {
    in_batch: u64,
    out_batch: u64,
    keys: u64,
    values: u64,
    /// In: entries to process. Out: entries processed (written back only
    /// once the kernel starts processing; an early refusal leaves it).
    count: u32,
    map_fd: u32,
    elem_flags: u64,
    flags: u64,
}

const _: () = {
    assert!(size_of::<BatchAttr>() == 56);
    assert!(offset_of!(BatchAttr, in_batch) == 0);
    assert!(offset_of!(BatchAttr, out_batch) == 8);
    assert!(offset_of!(BatchAttr, keys) == 16);
    assert!(offset_of!(BatchAttr, values) == 24);
    assert!(offset_of!(BatchAttr, count) == 32);
    assert!(offset_of!(BatchAttr, map_fd) == 36);
    assert!(offset_of!(BatchAttr, elem_flags) == 40);
    assert!(offset_of!(BatchAttr, flags) == 48);
};

/// `union bpf_attr`'s element member (`BPF_MAP_{LOOKUP,UPDATE,DELETE}_ELEM`).
#[repr(C, align(8))]
#[derive(Debug, Default)]
struct ElemAttr {
    map_fd: u32,
    _pad: u32,
    key: u64,
    value: u64,
    flags: u64,
}

const _: () = {
    assert!(size_of::<ElemAttr>() == 32);
    assert!(offset_of!(ElemAttr, key) == 8);
    assert!(offset_of!(ElemAttr, value) == 16);
    assert!(offset_of!(ElemAttr, flags) == 24);
};

#[derive(Debug, thiserror::Error)]
pub enum BatchError {
    #[error("reading the map's info: {0}")]
    Info(#[from] MapError),
    #[error("the key type is {size} bytes, the map's keys are {expected}")]
    KeySize { size: usize, expected: usize },
    #[error("the value type is {size} bytes, the map's values are {expected}")]
    ValueSize { size: usize, expected: usize },
    #[error("the map keeps one value per CPU: use update_batch_per_cpu")]
    PerCpuMap,
    #[error("the map keeps one value, not one per CPU: use update_batch")]
    NotPerCpuMap,
    #[error("entry {index} has {got} per-CPU values, the kernel has {nr_cpus} possible CPUs")]
    PerCpuCount {
        index: usize,
        got: usize,
        nr_cpus: usize,
    },
    #[error("counting the possible CPUs: {0}")]
    NrCpus(io::Error),
    /// Entries `..index` were written (or deleted); `index` and what follows
    /// were not.
    #[error("map entry {index} (of {total}): {source}")]
    Entry {
        index: usize,
        total: usize,
        #[source]
        source: io::Error,
    },
}

impl BatchError {
    /// For `Entry`, how many entries were written before the failure.
    pub fn written(&self) -> usize {
        match self {
            Self::Entry { index, .. } => *index,
            _ => 0,
        }
    }
}

/// Writes `entries` in order with `BPF_MAP_UPDATE_BATCH`, as many per
/// syscall as fit in 1 MiB; `flags` are the per-element flags
/// (`BPF_ANY` = 0, `BPF_NOEXIST`, `BPF_EXIST`, `BPF_F_LOCK`). Falls back to
/// per-entry updates where the kernel has no batch update for the map type
/// or flags. Returns the number of entries written (`entries.len()`).
///
/// For a per-CPU map use [`update_batch_per_cpu`].
pub fn update_batch<K: Pod, V: Pod>(
    map: &MapData,
    entries: &[(K, V)],
    flags: u64,
) -> Result<usize, BatchError> {
    update_batch_chunked(map, entries, flags, CHUNK_BYTES).map(|r| r.written)
}

/// [`update_batch`] for per-CPU maps (per-CPU hash and array, LRU per-CPU
/// hash): each entry carries one value per possible CPU, as
/// `aya::maps::PerCpuValues` does (`&values[..]`).
pub fn update_batch_per_cpu<K: Pod, V: Pod>(
    map: &MapData,
    entries: &[(K, &[V])],
    flags: u64,
) -> Result<usize, BatchError> {
    update_batch_per_cpu_chunked(map, entries, flags, CHUNK_BYTES).map(|r| r.written)
}

/// Deletes `keys` in order with `BPF_MAP_DELETE_BATCH` (per-entry
/// `BPF_MAP_DELETE_ELEM` where the map type has no batch delete). A key
/// that is not in the map stops it with `ENOENT`, as a single delete would.
pub fn delete_batch<K: Pod>(map: &MapData, keys: &[K]) -> Result<usize, BatchError> {
    delete_batch_chunked(map, keys, CHUNK_BYTES).map(|r| r.written)
}

/// Every entry of a hash map (`BPF_MAP_TYPE_HASH`, LRU hash), read with
/// `BPF_MAP_LOOKUP_BATCH`: a few syscalls for the whole map, where aya's
/// iteration makes two per entry (next key, lookup). At 10,000 endpoints
/// that read-back was more than a tenth of a round. `None` where the kernel has no
/// batch lookup for the map (the caller iterates instead).
pub fn lookup_batch<K: Pod, V: Pod>(map: &MapData) -> Result<Option<Vec<(K, V)>>, BatchError> {
    if check::<K, V>(map)? {
        return Err(BatchError::PerCpuMap);
    }
    let info = map.info()?;
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    // Staging starts small and doubles while calls come back full, up to
    // CHUNK_BYTES: most maps read back each round hold a few entries, and
    // a zeroed MiB per map and round was most of this function's time.
    let most = (CHUNK_BYTES / (ks + vs).max(1)).clamp(1, info.max_entries().max(1) as usize);
    let mut per_call = (FIRST_CHUNK_BYTES / (ks + vs).max(1)).clamp(1, most);
    let fd = map.fd().as_fd();
    let mut out = Vec::new();
    // The position between calls: a hash map's is a bucket index (u32);
    // room for a key, as other map types want.
    let mut in_batch = vec![0u64; ks.div_ceil(8).max(1)];
    let mut out_batch = vec![0u64; ks.div_ceil(8).max(1)];
    let mut first = true;
    // Staging for one call, made once (grown only on ENOSPC below).
    let mut keys = vec![0u8; per_call * ks];
    let mut values = vec![0u8; per_call * vs];
    loop {
        let mut attr = BatchAttr {
            in_batch: if first { 0 } else { in_batch.as_ptr() as u64 },
            out_batch: out_batch.as_mut_ptr() as u64,
            keys: keys.as_mut_ptr() as u64,
            values: values.as_mut_ptr() as u64,
            count: per_call as u32,
            map_fd: fd.as_raw_fd() as u32,
            ..Default::default()
        };
        // SAFETY: `attr` is a valid `bpf_attr.batch`; the kernel writes at
        // most `count` keys and values of the map's sizes (checked against
        // K and V) into `keys` and `values`, and a position into
        // `out_batch`, which has room for a key.
        let result = unsafe { sys_bpf(BPF_MAP_LOOKUP_BATCH, &mut attr) };
        let got = (attr.count as usize).min(per_call);
        let done = match &result {
            Ok(()) => false,
            Err(e) if e.raw_os_error() == Some(libc::ENOENT) => true,
            // A bucket holds more entries than one call returns: ask for more.
            Err(e)
                if e.raw_os_error() == Some(libc::ENOSPC)
                    && got == 0
                    && per_call <= info.max_entries() as usize =>
            {
                per_call *= 2;
                keys.resize(per_call * ks, 0);
                values.resize(per_call * vs, 0);
                continue;
            }
            Err(e)
                if first
                    && matches!(
                        e.raw_os_error(),
                        Some(libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP)
                    ) =>
            {
                return Ok(None);
            }
            Err(e) => {
                return Err(BatchError::Entry {
                    index: out.len(),
                    total: out.len(),
                    source: io::Error::from_raw_os_error(e.raw_os_error().unwrap_or(0)),
                });
            }
        };
        for j in 0..got {
            // SAFETY: j < got <= per_call entries of these sizes were
            // written by the kernel; K and V are Pod.
            let (k, v) = unsafe {
                (
                    ptr::read_unaligned(keys.as_ptr().add(j * ks).cast::<K>()),
                    ptr::read_unaligned(values.as_ptr().add(j * vs).cast::<V>()),
                )
            };
            out.push((k, v));
        }
        if done {
            return Ok(Some(out));
        }
        if got == per_call && per_call < most {
            per_call = (per_call * 2).min(most);
            keys.resize(per_call * ks, 0);
            values.resize(per_call * vs, 0);
        }
        std::mem::swap(&mut in_batch, &mut out_batch);
        first = false;
    }
}

/// What a call did, for tests and measurements.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Report {
    pub written: usize,
    /// Batch syscalls issued (including one refused by the kernel).
    pub batch_calls: usize,
    /// Per-entry syscalls issued (the fallback).
    pub elem_calls: usize,
}

fn is_per_cpu(map_type: MapType) -> bool {
    // BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE (deprecated in aya) is 21.
    matches!(
        map_type,
        MapType::PerCpuHash | MapType::PerCpuArray | MapType::LruPerCpuHash
    ) || map_type as u32 == 21
}

/// The map's key size, value size and whether it is per-CPU, checked
/// against `K` and `V`.
fn check<K, V>(map: &MapData) -> Result<bool, BatchError> {
    let info = map.info()?;
    let expected = info.key_size() as usize;
    if size_of::<K>() != expected {
        return Err(BatchError::KeySize {
            size: size_of::<K>(),
            expected,
        });
    }
    let expected = info.value_size() as usize;
    if size_of::<V>() != expected {
        return Err(BatchError::ValueSize {
            size: size_of::<V>(),
            expected,
        });
    }
    // Map types aya 0.14 does not know are newer than every per-CPU type.
    Ok(info.map_type().is_ok_and(is_per_cpu))
}

/// Writes `value`'s bytes into `buf` at offset `at`.
fn put<T: Pod>(buf: &mut [u8], at: usize, value: &T) {
    assert!(at + size_of::<T>() <= buf.len());
    // SAFETY: the assert keeps the write inside `buf`; T is Pod.
    unsafe { ptr::write_unaligned(buf.as_mut_ptr().add(at).cast::<T>(), *value) }
}

pub(crate) fn update_batch_chunked<K: Pod, V: Pod>(
    map: &MapData,
    entries: &[(K, V)],
    flags: u64,
    chunk_bytes: usize,
) -> Result<Report, BatchError> {
    if entries.is_empty() {
        return Ok(Report::default());
    }
    if check::<K, V>(map)? {
        return Err(BatchError::PerCpuMap);
    }
    let (ks, vs) = (size_of::<K>(), size_of::<V>());
    drive(
        map.fd().as_fd(),
        Op::Update(flags),
        entries.len(),
        ks,
        vs,
        chunk_bytes,
        |range, keys, values| {
            for (j, (k, v)) in entries[range].iter().enumerate() {
                put(keys, j * ks, k);
                put(values, j * vs, v);
            }
        },
    )
}

pub(crate) fn update_batch_per_cpu_chunked<K: Pod, V: Pod>(
    map: &MapData,
    entries: &[(K, &[V])],
    flags: u64,
    chunk_bytes: usize,
) -> Result<Report, BatchError> {
    if entries.is_empty() {
        return Ok(Report::default());
    }
    if !check::<K, V>(map)? {
        return Err(BatchError::NotPerCpuMap);
    }
    let nr_cpus = aya::util::nr_cpus().map_err(|(_, e)| BatchError::NrCpus(e))?;
    if let Some((index, (_, v))) = entries
        .iter()
        .enumerate()
        .find(|(_, (_, v))| v.len() != nr_cpus)
    {
        return Err(BatchError::PerCpuCount {
            index,
            got: v.len(),
            nr_cpus,
        });
    }
    // The kernel's per-CPU value: each CPU's value 8-byte aligned, for
    // every possible CPU (bpf_map_value_size()).
    let ks = size_of::<K>();
    let stride = size_of::<V>().next_multiple_of(8);
    let vs = stride * nr_cpus;
    drive(
        map.fd().as_fd(),
        Op::Update(flags),
        entries.len(),
        ks,
        vs,
        chunk_bytes,
        |range, keys, values| {
            for (j, (k, per_cpu)) in entries[range].iter().enumerate() {
                put(keys, j * ks, k);
                for (cpu, v) in per_cpu.iter().enumerate() {
                    put(values, j * vs + cpu * stride, v);
                }
            }
        },
    )
}

pub(crate) fn delete_batch_chunked<K: Pod>(
    map: &MapData,
    keys: &[K],
    chunk_bytes: usize,
) -> Result<Report, BatchError> {
    if keys.is_empty() {
        return Ok(Report::default());
    }
    let info = map.info()?;
    let expected = info.key_size() as usize;
    if size_of::<K>() != expected {
        return Err(BatchError::KeySize {
            size: size_of::<K>(),
            expected,
        });
    }
    let ks = size_of::<K>();
    drive(
        map.fd().as_fd(),
        Op::Delete,
        keys.len(),
        ks,
        0,
        chunk_bytes,
        |range, buf, _| {
            for (j, k) in keys[range].iter().enumerate() {
                put(buf, j * ks, k);
            }
        },
    )
}

#[derive(Clone, Copy)]
enum Op {
    Update(u64),
    Delete,
}

/// Stages `total` entries chunk by chunk (`fill` writes a chunk's keys and
/// values at `key_size`/`value_size` strides) and hands each chunk to the
/// kernel: one batch syscall, or per-entry syscalls once the kernel has
/// refused the batch command.
fn drive(
    fd: BorrowedFd<'_>,
    op: Op,
    total: usize,
    key_size: usize,
    value_size: usize,
    chunk_bytes: usize,
    mut fill: impl FnMut(std::ops::Range<usize>, &mut [u8], &mut [u8]),
) -> Result<Report, BatchError> {
    let per_chunk = (chunk_bytes / (key_size + value_size).max(1)).clamp(1, u32::MAX as usize);
    let cap = per_chunk.min(total);
    let mut keys = vec![0u8; cap * key_size];
    let mut values = vec![0u8; cap * value_size];
    let mut report = Report::default();
    let mut batched = true;
    let mut start = 0;
    while start < total {
        let end = (start + per_chunk).min(total);
        let n = end - start;
        let (keys, values) = (&mut keys[..n * key_size], &mut values[..n * value_size]);
        fill(start..end, keys, values);
        if batched {
            report.batch_calls += 1;
            match sys_batch(fd, op, keys, values, n as u32) {
                Ok(()) => {
                    start = end;
                    continue;
                }
                Err((e, done)) => {
                    let code = e.raw_os_error().unwrap_or(0);
                    let refused =
                        done == 0 && matches!(code, libc::EINVAL | libc::EOPNOTSUPP | ENOTSUPP);
                    if !refused {
                        return Err(BatchError::Entry {
                            index: start + done,
                            total,
                            source: e,
                        });
                    }
                    // Nothing in this chunk was touched: the map type or
                    // the flags have no batch form (or entry `start` is
                    // bad, which the per-entry call will say).
                    batched = false;
                }
            }
        }
        for j in 0..n {
            report.elem_calls += 1;
            let key = &keys[j * key_size..][..key_size];
            let value = &values[j * value_size..][..value_size];
            sys_elem(fd, op, key, value).map_err(|source| BatchError::Entry {
                index: start + j,
                total,
                source,
            })?;
        }
        start = end;
    }
    report.written = total;
    Ok(report)
}

/// One batch syscall over `n` staged entries; on error, the error and how
/// many entries the kernel processed before it (0 when it refused the
/// command outright; unknown, so 0, on `EFAULT`).
fn sys_batch(
    fd: BorrowedFd<'_>,
    op: Op,
    keys: &[u8],
    values: &[u8],
    n: u32,
) -> Result<(), (io::Error, usize)> {
    let (cmd, elem_flags, values) = match op {
        Op::Update(flags) => (BPF_MAP_UPDATE_BATCH, flags, values.as_ptr() as u64),
        Op::Delete => (BPF_MAP_DELETE_BATCH, 0, 0),
    };
    let mut attr = BatchAttr {
        keys: keys.as_ptr() as u64,
        values,
        count: n,
        map_fd: fd.as_raw_fd() as u32,
        elem_flags,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid `bpf_attr.batch`; the kernel reads `n`
    // keys and values of the map's sizes, which the callers staged in
    // `keys` and `values` (checked against the map), and writes only
    // `attr.count`.
    let Err(e) = (unsafe { sys_bpf(cmd, &mut attr) }) else {
        return Ok(());
    };
    // The kernel zeroes `count` once it starts, then writes back how many
    // it processed; a refusal before that leaves our `n` in place.
    let done = attr.count as usize;
    let done = if done >= n as usize || e.raw_os_error() == Some(libc::EFAULT) {
        0
    } else {
        done
    };
    Err((e, done))
}

/// One `BPF_MAP_UPDATE_ELEM` or `BPF_MAP_DELETE_ELEM`.
fn sys_elem(fd: BorrowedFd<'_>, op: Op, key: &[u8], value: &[u8]) -> io::Result<()> {
    let (cmd, flags, value) = match op {
        Op::Update(flags) => (BPF_MAP_UPDATE_ELEM, flags, value.as_ptr() as u64),
        Op::Delete => (BPF_MAP_DELETE_ELEM, 0, 0),
    };
    let mut attr = ElemAttr {
        map_fd: fd.as_raw_fd() as u32,
        key: key.as_ptr() as u64,
        value,
        flags,
        ..Default::default()
    };
    // SAFETY: `attr` is a valid element `bpf_attr`; the kernel reads one
    // key and one value of the map's sizes from the staged slices.
    unsafe { sys_bpf(cmd, &mut attr) }
}

/// `bpf(cmd, attr, sizeof attr)`.
///
/// # Safety
/// `attr` must be the `bpf_attr` layout `cmd` expects, and every pointer
/// in it valid for what the kernel reads and writes.
// SAFETY: unsafe because the kernel dereferences the pointers inside `attr`;
// callers uphold the `# Safety` contract above.
unsafe fn sys_bpf<A>(cmd: libc::c_int, attr: &mut A) -> io::Result<()> {
    // SAFETY: by the caller's contract `attr` is the layout `cmd` expects; it is a
    // live `&mut` for the call and the size passed is `A`'s own.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_bpf,
            cmd,
            attr as *mut A,
            size_of::<A>() as libc::c_uint,
        )
    };
    if ret == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    //! Real maps; needs root (CAP_BPF), as the rest of the suite.

    use std::os::fd::{FromRawFd as _, OwnedFd};

    use aya::maps::{
        Array, HashMap, IterableMap as _, Map, PerCpuArray, PerCpuHashMap, PerCpuValues,
        lpm_trie::{Key as LpmKey, LpmTrie},
    };

    use super::*;

    const N: u32 = 10_000;

    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(C)]
    struct Val {
        a: u64,
        b: u32,
        c: u16,
        d: u16,
    }
    // SAFETY: repr(C), no padding, every bit pattern valid.
    unsafe impl Pod for Val {}

    fn val(i: u32) -> Val {
        Val {
            a: u64::from(i) * 0x1_0000_0001,
            b: !i,
            c: i as u16,
            d: (i >> 3) as u16,
        }
    }

    /// A 12-byte key (not a multiple of 8), like the project's address keys.
    #[derive(Clone, Copy, Debug, PartialEq, Eq)]
    #[repr(C)]
    struct Key3 {
        a: u32,
        b: u32,
        c: u32,
    }
    // SAFETY: repr(C), no padding, every bit pattern valid.
    unsafe impl Pod for Key3 {}

    fn key3(i: u32) -> Key3 {
        Key3 {
            a: i,
            b: i.wrapping_mul(2_654_435_761),
            c: 7,
        }
    }

    /// BPF_MAP_CREATE for types aya 0.14 cannot create standalone.
    fn create_raw(map_type: u32, key_size: u32, value_size: u32, max: u32) -> MapData {
        #[repr(C, align(8))]
        #[derive(Default)]
        struct CreateAttr {
            map_type: u32,
            key_size: u32,
            value_size: u32,
            max_entries: u32,
            map_flags: u32,
        }
        let mut attr = CreateAttr {
            map_type,
            key_size,
            value_size,
            max_entries: max,
            ..Default::default()
        };
        // SAFETY: a valid prefix of bpf_attr for BPF_MAP_CREATE.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_bpf,
                0,
                &mut attr as *mut CreateAttr,
                size_of::<CreateAttr>() as libc::c_uint,
            )
        };
        assert!(
            fd >= 0,
            "BPF_MAP_CREATE type {map_type}: {} (tests need root)",
            io::Error::last_os_error()
        );
        // SAFETY: the kernel just returned this fd to us.
        MapData::from_fd(unsafe { OwnedFd::from_raw_fd(fd as i32) }).unwrap()
    }

    fn errno(e: &BatchError) -> (usize, Option<i32>) {
        match e {
            BatchError::Entry { index, source, .. } => (*index, source.raw_os_error()),
            other => panic!("expected an entry error, got {other:?}"),
        }
    }

    #[test]
    fn hash_10k_round_trip() {
        let map = HashMap::<_, Key3, Val>::create(N, 0).expect("creating a hash map (root?)");
        let entries: Vec<_> = (0..N).map(|i| (key3(i), val(i))).collect();
        // Small chunks so the run crosses many chunk boundaries.
        let r = update_batch_chunked(map.map(), &entries, 0, 4096).unwrap();
        assert_eq!(r.written, N as usize);
        assert_eq!(r.elem_calls, 0, "hash maps have a batch update");
        assert_eq!(r.batch_calls, (N as usize).div_ceil(4096 / 28));
        for i in 0..N {
            assert_eq!(map.get(&key3(i), 0).unwrap(), val(i), "entry {i}");
        }
        assert_eq!(map.keys().count(), N as usize);
        // Overwrite through the public entry point.
        let entries: Vec<_> = (0..N).map(|i| (key3(i), val(i + 1))).collect();
        assert_eq!(update_batch(map.map(), &entries, 0).unwrap(), N as usize);
        for i in 0..N {
            assert_eq!(map.get(&key3(i), 0).unwrap(), val(i + 1), "entry {i}");
        }
    }

    #[test]
    fn lookup_batch_reads_every_entry_of_a_hash_map() {
        let map = HashMap::<_, Key3, Val>::create(N, 0).unwrap();
        let empty: Vec<(Key3, Val)> = lookup_batch(map.map()).unwrap().expect("hash maps have it");
        assert!(empty.is_empty());
        let entries: Vec<_> = (0..N).map(|i| (key3(i), val(i))).collect();
        update_batch(map.map(), &entries, 0).unwrap();
        let mut read: Vec<(Key3, Val)> = lookup_batch(map.map()).unwrap().unwrap();
        assert_eq!(read.len(), N as usize);
        read.sort_by_key(|(k, _)| k.a);
        let mut want = entries.clone();
        want.sort_by_key(|(k, _)| k.a);
        assert!(read == want, "every entry, once, with its value");
        // The wrong key type is refused, not read.
        assert!(matches!(
            lookup_batch::<u32, Val>(map.map()),
            Err(BatchError::KeySize { .. })
        ));
    }

    #[test]
    fn lru_hash_10k_round_trip() {
        // BPF_MAP_TYPE_LRU_HASH = 9; room to spare so nothing is evicted.
        let data = create_raw(9, 4, size_of::<Val>() as u32, 2 * N);
        let entries: Vec<_> = (0..N).map(|i| (i, val(i))).collect();
        let r = update_batch_chunked(&data, &entries, 0, 1000).unwrap();
        assert_eq!((r.written, r.elem_calls), (N as usize, 0));
        let map = HashMap::<_, u32, Val>::try_from(Map::LruHashMap(data)).unwrap();
        for i in 0..N {
            assert_eq!(map.get(&i, 0).unwrap(), val(i), "entry {i}");
        }
    }

    #[test]
    fn array_10k_round_trip() {
        let map = Array::<_, Val>::create(N, 0).unwrap();
        // Out of order: batch entries need not be sorted.
        let entries: Vec<_> = (0..N).rev().map(|i| (i, val(i))).collect();
        let r = update_batch_chunked(map.map(), &entries, 0, 10_000).unwrap();
        assert_eq!((r.written, r.elem_calls), (N as usize, 0));
        for i in 0..N {
            assert_eq!(map.get(&i, 0).unwrap(), val(i), "entry {i}");
        }
    }

    #[test]
    fn per_cpu_hash_10k_round_trip() {
        let nr_cpus = aya::util::nr_cpus().unwrap();
        // A 12-byte value: each CPU's copy sits at an 8-byte stride.
        let map = PerCpuHashMap::<_, u32, Key3>::create(N, 0).unwrap();
        let values: Vec<Vec<Key3>> = (0..N)
            .map(|i| (0..nr_cpus as u32).map(|c| key3(i * 64 + c)).collect())
            .collect();
        let entries: Vec<(u32, &[Key3])> = (0..N).map(|i| (i, &values[i as usize][..])).collect();
        let r = update_batch_per_cpu_chunked(map.map(), &entries, 0, 64 * 1024).unwrap();
        assert_eq!((r.written, r.elem_calls), (N as usize, 0));
        for i in 0..N {
            let got = map.get(&i, 0).unwrap();
            assert_eq!(&got[..], &values[i as usize][..], "entry {i}");
        }
        // The port_stats case: one zero shared by every entry.
        let zero = vec![key3(0); nr_cpus];
        let entries: Vec<(u32, &[Key3])> = (0..N).map(|i| (i, &zero[..])).collect();
        update_batch_per_cpu(map.map(), &entries, 0).unwrap();
        assert!((0..N).all(|i| map.get(&i, 0).unwrap().iter().all(|v| *v == key3(0))));
    }

    #[test]
    fn per_cpu_array_round_trip() {
        let nr_cpus = aya::util::nr_cpus().unwrap();
        let map = PerCpuArray::<_, u64>::create(64, 0).unwrap();
        let values: Vec<PerCpuValues<u64>> = (0..64u64)
            .map(|i| {
                PerCpuValues::try_from(
                    (0..nr_cpus as u64)
                        .map(|c| (i << 8) | c)
                        .collect::<Vec<_>>(),
                )
                .unwrap()
            })
            .collect();
        let entries: Vec<(u32, &[u64])> =
            (0..64u32).map(|i| (i, &values[i as usize][..])).collect();
        assert_eq!(update_batch_per_cpu(map.map(), &entries, 0).unwrap(), 64);
        for i in 0..64u32 {
            assert_eq!(&map.get(&i, 0).unwrap()[..], &values[i as usize][..]);
        }
    }

    #[test]
    fn lpm_trie_batch() {
        let map = LpmTrie::<_, u32, u32>::create(1024, 1 /* BPF_F_NO_PREALLOC */).unwrap();
        let entries: Vec<_> = (0..1000u32)
            .map(|i| (LpmKey::new(32, (0x0a00_0000 | i).to_be()), i))
            .collect();
        let r = update_batch_chunked(map.map(), &entries, 0, CHUNK_BYTES).unwrap();
        assert_eq!((r.written, r.elem_calls), (1000, 0));
        for i in 0..1000u32 {
            assert_eq!(
                map.get(&LpmKey::new(32, (0x0a00_0000 | i).to_be()), 0)
                    .unwrap(),
                i
            );
        }
    }

    #[test]
    fn fallback_for_a_map_type_without_batch_ops() {
        // BPF_MAP_TYPE_DEVMAP = 14: no batch ops (ENOTSUPP); value =
        // struct bpf_devmap_val { ifindex, prog fd }, the size aya reads.
        let data = create_raw(14, 4, 8, 64);
        let entries: Vec<(u32, [u32; 2])> = (0..64).map(|i| (i, [1, 0])).collect(); // lo
        let r = update_batch_chunked(&data, &entries, 0, 16 * 12).unwrap();
        assert_eq!(
            r,
            Report {
                written: 64,
                batch_calls: 1,
                elem_calls: 64
            }
        );
        let map = aya::maps::DevMap::try_from(Map::DevMap(data)).unwrap();
        for i in 0..64 {
            assert_eq!(map.get(i, 0).unwrap().if_index, 1, "entry {i}");
        }
    }

    #[test]
    fn fallback_for_flags_the_batch_refuses() {
        let map = HashMap::<_, u32, Val>::create(1000, 0).unwrap();
        let first: Vec<_> = (0..500).map(|i| (i, val(i))).collect();
        update_batch(map.map(), &first, 0).unwrap();
        // BPF_EXIST: the kernel's batch update refuses it (EINVAL); per
        // entry it works.
        let r = update_batch_chunked(map.map(), &first[..100], BPF_EXIST, 400).unwrap();
        assert_eq!((r.batch_calls, r.elem_calls), (1, 100));
        // BPF_NOEXIST with entry 57 of the input already present: 0..57
        // written, the error names 57.
        let mut second: Vec<_> = (500..600).map(|i| (i, val(i))).collect();
        second[57] = (3, val(3));
        let e = update_batch(map.map(), &second, BPF_NOEXIST).unwrap_err();
        assert_eq!(errno(&e), (57, Some(libc::EEXIST)));
        assert_eq!(e.written(), 57);
        for i in 500..557 {
            assert_eq!(map.get(&i, 0).unwrap(), val(i));
        }
        assert!(map.get(&557, 0).is_err());
        assert!(map.get(&599, 0).is_err());
    }

    #[test]
    fn too_many_for_a_small_hash_map() {
        let map = HashMap::<_, u32, Val>::create(100, 0).unwrap();
        let entries: Vec<_> = (0..150).map(|i| (i, val(i))).collect();
        // Chunks of 36 entries: entry 100 is the 29th of the third chunk.
        let e = update_batch_chunked(map.map(), &entries, 0, 36 * 20).unwrap_err();
        assert_eq!(errno(&e), (100, Some(libc::E2BIG)), "{e}");
        assert!(matches!(e, BatchError::Entry { total: 150, .. }));
        assert_eq!(map.keys().count(), 100);
        for i in 0..100 {
            assert_eq!(map.get(&i, 0).unwrap(), val(i));
        }
    }

    #[test]
    fn out_of_range_for_a_small_array() {
        let map = Array::<_, u64>::create(100, 0).unwrap();
        let entries: Vec<(u32, u64)> = (0..150).map(|i| (i, u64::from(i) + 1)).collect();
        let e = update_batch(map.map(), &entries, 0).unwrap_err();
        assert_eq!(errno(&e), (100, Some(libc::E2BIG)), "{e}");
        for i in 0..100 {
            assert_eq!(map.get(&i, 0).unwrap(), u64::from(i) + 1);
        }
    }

    #[test]
    fn delete_batch_hash_and_array_fallback() {
        let map = HashMap::<_, u32, u64>::create(N, 0).unwrap();
        let entries: Vec<(u32, u64)> = (0..N).map(|i| (i, u64::from(i))).collect();
        update_batch(map.map(), &entries, 0).unwrap();
        let evens: Vec<u32> = (0..N).step_by(2).collect();
        let r = delete_batch_chunked(map.map(), &evens, 4000).unwrap();
        assert_eq!((r.written, r.elem_calls), (evens.len(), 0));
        for i in 0..N {
            assert_eq!(map.get(&i, 0).is_ok(), i % 2 == 1, "entry {i}");
        }
        // A missing key stops the delete there.
        let keys = [1, 3, 4, 5];
        let e = delete_batch(map.map(), &keys).unwrap_err();
        assert_eq!(errno(&e), (2, Some(libc::ENOENT)));
        assert!(map.get(&1, 0).is_err() && map.get(&3, 0).is_err());
        assert!(map.get(&5, 0).is_ok());
        // Arrays have no delete at all: ENOTSUPP for the batch, then the
        // per-entry delete's EINVAL for entry 0.
        let arr = Array::<_, u64>::create(4, 0).unwrap();
        let e = delete_batch(arr.map(), &[0u32, 1]).unwrap_err();
        assert_eq!(errno(&e), (0, Some(libc::EINVAL)));
    }

    #[test]
    fn refuses_mismatched_types() {
        let map = HashMap::<_, u32, u64>::create(8, 0).unwrap();
        assert!(matches!(
            update_batch(map.map(), &[(1u32, 1u32)], 0),
            Err(BatchError::ValueSize {
                size: 4,
                expected: 8
            })
        ));
        assert!(matches!(
            update_batch(map.map(), &[(1u64, 1u64)], 0),
            Err(BatchError::KeySize {
                size: 8,
                expected: 4
            })
        ));
        assert!(matches!(
            update_batch_per_cpu(map.map(), &[(1u32, &[1u64][..])], 0),
            Err(BatchError::NotPerCpuMap)
        ));
        let pc = PerCpuHashMap::<_, u32, u64>::create(8, 0).unwrap();
        assert!(matches!(
            update_batch(pc.map(), &[(1u32, 1u64)], 0),
            Err(BatchError::PerCpuMap)
        ));
        let nr_cpus = aya::util::nr_cpus().unwrap();
        let short = vec![0u64; nr_cpus - 1];
        let good = vec![0u64; nr_cpus];
        assert!(matches!(
            update_batch_per_cpu(pc.map(), &[(1u32, &good[..]), (2, &short[..])], 0),
            Err(BatchError::PerCpuCount { index: 1, .. })
        ));
        assert_eq!(update_batch::<u32, u64>(map.map(), &[], 0).unwrap(), 0);
    }
}

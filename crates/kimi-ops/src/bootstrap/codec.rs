//! A little-endian byte codec for control messages (ids, counts, block tables, sampling
//! settings): [`Writer`] appends, [`Reader`] reads back in the same order and names what was
//! cut short or left over.

use super::BootstrapError;

/// Appends values to a message.
#[derive(Default, Debug)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty message.
    pub fn new() -> Self {
        Self::default()
    }
    /// The bytes written.
    pub fn finish(self) -> Vec<u8> {
        self.buf
    }
    /// One byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    /// A bool as one byte.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }
    /// A u32.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A u64 (counts and sizes: `usize` travels as u64).
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    /// A usize as a u64.
    pub fn usize(&mut self, v: usize) -> &mut Self {
        self.u64(v as u64)
    }
    /// An f32, bit for bit.
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.u32(v.to_bits())
    }
    /// A length-prefixed list of u32.
    pub fn u32s(&mut self, v: &[u32]) -> &mut Self {
        self.usize(v.len());
        v.iter().for_each(|&x| {
            self.u32(x);
        });
        self
    }
    /// A length-prefixed UTF-8 string.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.usize(v.len());
        self.buf.extend_from_slice(v.as_bytes());
        self
    }
}

/// Reads a message written by [`Writer`].
#[derive(Debug)]
pub struct Reader<'a> {
    buf: &'a [u8],
    at: usize,
    /// What the message is, for errors.
    what: &'static str,
}

type Result<T> = std::result::Result<T, BootstrapError>;

impl<'a> Reader<'a> {
    /// Reads `buf`, a message of kind `what`.
    pub fn new(buf: &'a [u8], what: &'static str) -> Self {
        Self { buf, at: 0, what }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self.at.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.at..end];
                self.at = end;
                Ok(s)
            }
            None => Err(BootstrapError::Protocol(format!(
                "a {} message cut short: {n} more bytes wanted at byte {} of {}",
                self.what,
                self.at,
                self.buf.len()
            ))),
        }
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    /// A bool (0 or 1).
    pub fn bool(&mut self) -> Result<bool> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            b => Err(self.bad(format!("a bool of {b}"))),
        }
    }
    /// A u32.
    pub fn u32(&mut self) -> Result<u32> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    /// A u64.
    pub fn u64(&mut self) -> Result<u64> {
        let mut a = [0u8; 8];
        a.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(a))
    }
    /// A usize (written as a u64).
    pub fn usize(&mut self) -> Result<usize> {
        let v = self.u64()?;
        usize::try_from(v).map_err(|_| self.bad(format!("a size of {v}")))
    }
    /// An f32.
    pub fn f32(&mut self) -> Result<f32> {
        Ok(f32::from_bits(self.u32()?))
    }
    /// A count of items of at least `item_bytes` each that the rest of the message can hold.
    pub fn count(&mut self, item_bytes: usize) -> Result<usize> {
        let n = self.usize()?;
        if n.saturating_mul(item_bytes.max(1)) > self.buf.len() - self.at {
            return Err(self.bad(format!("a list of {n} items in {} bytes", self.buf.len())));
        }
        Ok(n)
    }
    /// A list of u32.
    pub fn u32s(&mut self) -> Result<Vec<u32>> {
        let n = self.count(4)?;
        (0..n).map(|_| self.u32()).collect()
    }
    /// A string.
    pub fn str(&mut self) -> Result<String> {
        let n = self.count(1)?;
        let b = self.take(n)?;
        String::from_utf8(b.to_vec()).map_err(|_| self.bad("a string that is not UTF-8".into()))
    }
    /// Checks that the whole message was read.
    pub fn end(&self) -> Result<()> {
        match self.buf.len() - self.at {
            0 => Ok(()),
            n => Err(self.bad(format!("{n} bytes left over"))),
        }
    }
    /// An error naming the message.
    pub fn bad(&self, what: String) -> BootstrapError {
        BootstrapError::Protocol(format!("a {} message: {what}", self.what))
    }
}

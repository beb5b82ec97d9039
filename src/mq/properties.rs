//! A delivered message's properties, holding the client's own strings.
//!
//! The client decodes each message's properties once; a delivery keeps those strings (short
//! ones inline, longer ones shared by reference count) instead of copying every key and value
//! into a fresh map. On the order consumer's path that copy, built and dropped for every
//! message, was 7 % of the process's CPU (BENCHMARKS.md, "The order work's price").

use std::fmt;
use std::ops::Index;

use cheetah_string::CheetahString;
use serde::ser::{Serialize, SerializeMap, Serializer};

/// Key-value properties of one delivered message (the pipeline's lower-case ones and the
/// broker's upper-case ones). A handful per message: looked up by a scan, in arrival order.
#[derive(Clone, Default, PartialEq, Eq)]
pub struct Properties(Vec<(CheetahString, CheetahString)>);

impl Properties {
    /// The value of `key`, if the message carries it.
    pub fn get(&self, key: &str) -> Option<&str> {
        self.0
            .iter()
            .find(|(k, _)| k.as_str() == key)
            .map(|(_, v)| v.as_str())
    }

    pub fn contains_key(&self, key: &str) -> bool {
        self.get(key).is_some()
    }

    /// Sets `key` to `value`, replacing an earlier value.
    pub fn insert(&mut self, key: impl Into<CheetahString>, value: impl Into<CheetahString>) {
        let (key, value) = (key.into(), value.into());
        match self.0.iter_mut().find(|(k, _)| *k == key) {
            Some((_, v)) => *v = value,
            None => self.0.push((key, value)),
        }
    }

    /// Removes `key`; its value, if it was there.
    pub fn remove(&mut self, key: &str) -> Option<String> {
        let at = self.0.iter().position(|(k, _)| k.as_str() == key)?;
        Some(self.0.swap_remove(at).1.into())
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn keys(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(|(k, _)| k.as_str())
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

impl<K: Into<CheetahString>, V: Into<CheetahString>> FromIterator<(K, V)> for Properties {
    fn from_iter<I: IntoIterator<Item = (K, V)>>(iter: I) -> Self {
        let mut out = Properties::default();
        out.extend(iter);
        out
    }
}

impl<K: Into<CheetahString>, V: Into<CheetahString>> Extend<(K, V)> for Properties {
    fn extend<I: IntoIterator<Item = (K, V)>>(&mut self, iter: I) {
        for (k, v) in iter {
            self.insert(k, v);
        }
    }
}

impl<K: Into<CheetahString>, V: Into<CheetahString>, const N: usize> From<[(K, V); N]>
    for Properties
{
    fn from(pairs: [(K, V); N]) -> Self {
        pairs.into_iter().collect()
    }
}

impl Index<&str> for Properties {
    type Output = str;

    /// Like a map's index: panics when the message does not carry `key`.
    fn index(&self, key: &str) -> &str {
        self.get(key)
            .unwrap_or_else(|| panic!("no property {key:?} in {self:?}"))
    }
}

impl fmt::Debug for Properties {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// A JSON object of the properties (how quarantine and the dead-letter records store them).
impl Serialize for Properties {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (k, v) in self.iter() {
            map.serialize_entry(k, v)?;
        }
        map.end()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_like_the_map_it_replaces() {
        let mut p = Properties::from([("message_id", "evt_1"), ("TAGS", "CREATE_ORDER")]);
        assert_eq!(p.get("message_id"), Some("evt_1"));
        assert_eq!(&p["TAGS"], "CREATE_ORDER");
        assert_eq!(p.get("order_id"), None);
        p.insert("message_id", "evt_2".to_string());
        assert_eq!(p.len(), 2, "a key set twice is held once");
        assert_eq!(p.get("message_id"), Some("evt_2"));
        assert_eq!(p.remove("TAGS").as_deref(), Some("CREATE_ORDER"));
        assert!(!p.contains_key("TAGS"));
        assert_eq!(
            serde_json::to_value(&p).unwrap(),
            serde_json::json!({"message_id": "evt_2"})
        );
    }
}

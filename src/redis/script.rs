//! The Lua scripts with named arguments. Each script opens with two tables, `local K = {...}`
//! naming its KEYS and `local A = {...}` naming its ARGV, one entry a line
//! (`meta = KEYS[1],`); its body reads only `K.meta`, `A.now_ms`. A caller passes each
//! argument by the same name ([`Call::key`], [`Call::arg`]): a name out of the script's order
//! fails every debug build's test that reaches the call, and `names_of_every_script` below
//! fails on a table that skips or repeats a position or a body that reads `KEYS[n]` itself.

use deadpool_redis::redis::{self, Script, ScriptInvocation, ToRedisArgs};

/// A script and the names its opening tables give its KEYS and ARGV, in order.
pub(super) struct LuaScript {
    pub(super) script: Script,
    name: &'static str,
    keys: Vec<&'static str>,
    argv: Vec<&'static str>,
}

impl LuaScript {
    /// `name` is the file's stem (for messages); a source whose tables are malformed panics:
    /// the sources are compiled in, and the unit test below builds every one.
    pub(super) fn new(name: &'static str, source: &'static str) -> Self {
        let names = |var: &str, array: &str| {
            table_names(source, var, array).unwrap_or_else(|e| panic!("{name}.lua: {e}"))
        };
        Self {
            script: Script::new(source),
            name,
            keys: names("K", "KEYS"),
            argv: names("A", "ARGV"),
        }
    }

    /// A call to fill in, argument by named argument.
    pub(super) fn call(&self) -> Call<'_> {
        Call {
            script: self,
            inv: self.script.prepare_invoke(),
            keys: 0,
            args: 0,
        }
    }
}

/// One invocation being filled in: keys, then arguments, each by its name in the script.
pub(super) struct Call<'a> {
    script: &'a LuaScript,
    inv: ScriptInvocation<'a>,
    keys: usize,
    args: usize,
}

impl<'a> Call<'a> {
    /// The next key, which the script names `name`.
    pub(super) fn key(mut self, name: &str, key: impl ToRedisArgs) -> Self {
        debug_assert_eq!(
            self.script.keys.get(self.keys).copied(),
            Some(name),
            "{}.lua: KEYS[{}]",
            self.script.name,
            self.keys + 1
        );
        self.inv.key(key);
        self.keys += 1;
        self
    }

    /// The next argument, which the script names `name`.
    pub(super) fn arg(mut self, name: &str, arg: impl ToRedisArgs) -> Self {
        debug_assert_eq!(
            self.script.argv.get(self.args).copied(),
            Some(name),
            "{}.lua: ARGV[{}]",
            self.script.name,
            self.args + 1
        );
        self.inv.arg(arg);
        self.args += 1;
        self
    }

    /// Arguments past the named ones (a script that reads the rest of ARGV as a list).
    pub(super) fn rest(mut self, arg: impl ToRedisArgs) -> Self {
        debug_assert_eq!(
            self.args,
            self.script.argv.len(),
            "{}.lua: named ARGV first",
            self.script.name
        );
        self.inv.arg(arg);
        self
    }

    /// The invocation, every named key and argument given.
    pub(super) fn done(self) -> ScriptInvocation<'a> {
        debug_assert_eq!(
            (self.keys, self.args.min(self.script.argv.len())),
            (self.script.keys.len(), self.script.argv.len()),
            "{}.lua: (KEYS, ARGV) given",
            self.script.name
        );
        self.inv
    }

    pub(super) async fn invoke_async<T: redis::FromRedisValue>(
        self,
        conn: &mut impl redis::aio::ConnectionLike,
    ) -> redis::RedisResult<T> {
        let call = self.done();
        call.invoke_async(conn).await
    }
}

/// The names of `local <var> = { name = <array>[1], ... }`, checked to number 1, 2, ... in order.
fn table_names(source: &'static str, var: &str, array: &str) -> Result<Vec<&'static str>, String> {
    let open = format!("local {var} = {{");
    let start = source
        .find(&open)
        .ok_or_else(|| format!("no `{open}` table naming {array}"))?
        + open.len();
    let len = source[start..]
        .find("\n}")
        .ok_or_else(|| format!("the `{open}` table is not closed by a `}}` line"))?;
    let mut names = Vec::new();
    for line in source[start..start + len].lines() {
        let entry = line.split("--").next().unwrap_or("").trim();
        if entry.is_empty() {
            continue;
        }
        let (name, value) = entry
            .split_once('=')
            .ok_or_else(|| format!("`{entry}` in {var} is not `name = {array}[n],`"))?;
        let want = format!("{array}[{}],", names.len() + 1);
        if value.trim() != want {
            return Err(format!(
                "{var}.{} is `{}`, expected `{want}`",
                name.trim(),
                value.trim()
            ));
        }
        names.push(name.trim());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every script under src/redis/lua/, as `RedisStore::connect` builds them.
    pub(crate) fn every_script() -> Vec<(&'static str, &'static str)> {
        super::super::SOURCES.to_vec()
    }

    #[test]
    fn names_of_every_script() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/redis/lua");
        let on_disk = std::fs::read_dir(&dir).unwrap().count();
        assert_eq!(
            every_script().len(),
            on_disk,
            "a script in {dir:?} is not built"
        );
        for (name, source) in every_script() {
            let s = LuaScript::new(name, source);
            assert!(!s.keys.is_empty(), "{name}.lua names no KEYS");
            // Past the tables the body reads the names only.
            let body_from = source.find("local A = {").unwrap();
            let body = &source[body_from + source[body_from..].find("\n}").unwrap()..];
            for array in ["KEYS[", "ARGV["] {
                assert!(
                    !body.contains(array),
                    "{name}.lua reads {array}..] past its tables"
                );
            }
        }
    }

    #[test]
    fn a_table_out_of_order_is_refused() {
        let bad = "local K = {\n  a = KEYS[1],\n  b = KEYS[3],\n}\n";
        let e = table_names(bad, "K", "KEYS").unwrap_err();
        assert!(e.contains("K.b"), "{e}");
        assert!(table_names("local A = {\n}\n", "K", "KEYS").is_err());
    }

    #[test]
    #[cfg(debug_assertions)]
    #[should_panic(expected = "reserve.lua: KEYS[2]")]
    fn a_caller_out_of_order_fails_in_debug() {
        let (name, source) = every_script()
            .into_iter()
            .find(|(n, _)| *n == "reserve")
            .unwrap();
        let s = LuaScript::new(name, source);
        let _ = s.call().key("meta", "m").key("buyers", "b");
    }
}

//! Dockerfiles, parsed and checked before a build starts: the instructions agent images use
//! (`FROM`, `RUN`, `COPY`, `ADD` of local files, `ENV`, `ARG`, `WORKDIR`, `USER`, `ENTRYPOINT`,
//! `CMD`), one stage. Any other instruction, a second `FROM`, `COPY --from`, `ADD` of a URL or an
//! archive is refused naming it and its line. Variables (`$NAME`, `${NAME}`, `${NAME:-word}`)
//! from `ARG` and `ENV` are substituted where Docker substitutes them (not in `RUN`, whose shell
//! sees them in its environment). Pure: table-tested.

use std::collections::{BTreeMap, HashMap};

/// A command as written: the shell form (`/bin/sh -c TEXT`) or the exec form (a JSON array).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Command {
    Shell(String),
    Exec(Vec<String>),
}

impl Command {
    /// The argv that runs it.
    pub fn argv(&self) -> Vec<String> {
        match self {
            Self::Shell(s) => vec!["/bin/sh".into(), "-c".into(), s.clone()],
            Self::Exec(a) => a.clone(),
        }
    }
}

/// One instruction after `FROM`, with its variables substituted.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Step {
    /// Runs in the build's sandbox as `user` in `workdir` with `env` (the ARGs and ENVs so far).
    Run {
        command: Command,
        user: String,
        workdir: String,
        env: BTreeMap<String, String>,
    },
    /// Copies context paths (files, or directories whole) to `dest` (a directory when it ends
    /// in `/` or there are several sources), owned by `chown` (else root), `chmod` if given.
    Copy {
        sources: Vec<String>,
        dest: String,
        chown: Option<String>,
        chmod: Option<u32>,
    },
}

/// A Dockerfile, checked.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Dockerfile {
    /// `FROM`'s image: an Airlock template's name or an OCI reference.
    pub from: String,
    /// Each step with its line and its text (what its cache key hashes).
    pub steps: Vec<(usize, String, Step)>,
    /// What the template's executions get by default: `ENV`, `WORKDIR` and `USER` as they stand
    /// at the end (empty: the base's), `ENTRYPOINT` and `CMD`.
    pub env: BTreeMap<String, String>,
    pub workdir: String,
    pub user: String,
    pub entrypoint: Vec<String>,
    pub cmd: Vec<String>,
}

const SUPPORTED: &str =
    "FROM, RUN, COPY, ADD (local files), ENV, ARG, WORKDIR, USER, ENTRYPOINT, CMD";

/// Why a Dockerfile is refused: its Display is what the user reads (after `Dockerfile: `).
#[derive(Debug, thiserror::Error)]
pub enum DockerfileError {
    /// An instruction that cannot be taken as written.
    #[error("line {line}: {instr}: {why}")]
    Instruction {
        line: usize,
        instr: String,
        why: StepError,
    },
    #[error("line {line}: {instr} before FROM")]
    BeforeFrom { line: usize, instr: String },
    #[error("line {line}: {word} is not supported (supported: {supported})", supported = SUPPORTED)]
    Unsupported { line: usize, word: String },
    #[error("the Dockerfile has no FROM")]
    NoFrom,
    #[error("build argument {0:?} is not declared by an ARG")]
    UndeclaredArg(String),
}

/// What is wrong with one instruction.
#[derive(Debug, thiserror::Error)]
pub enum StepError {
    #[error("a second FROM: multi-stage builds are not supported")]
    SecondFrom,
    #[error("FROM IMAGE [AS NAME], without flags")]
    FromForm,
    #[error("an empty directory")]
    EmptyWorkdir,
    #[error("USER NAME[:GROUP] (one word)")]
    UserForm,
    #[error("RUN flags (--mount, --network, ...) are not supported")]
    RunFlags,
    #[error("{0:?} is not a variable name")]
    VariableName(String),
    /// `${` without its `}` in the text.
    #[error("an unclosed ${{ in {0:?}")]
    UnclosedBrace(String),
    #[error("an unclosed quote")]
    UnclosedQuote,
    #[error("{0:?} is not KEY=VALUE")]
    NotKeyValue(String),
    #[error("ENV KEY=VALUE ... or ENV KEY VALUE")]
    EnvForm,
    #[error("ENV KEY=VALUE ...")]
    EnvEmpty,
    #[error("no command")]
    NoCommand,
    #[error("an empty exec form")]
    EmptyExec,
    #[error("its JSON form: {0}")]
    Json(serde_json::Error),
    #[error("--chmod={0}: an octal mode")]
    Chmod(String),
    #[error("--from: multi-stage builds are not supported")]
    CopyFrom,
    #[error("{0} is not supported (--chown, --chmod)")]
    CopyFlag(String),
    /// Fewer than a source and a destination (the instruction's name).
    #[error("{0} SOURCE... DEST")]
    CopyForm(String),
    #[error("ADD of a URL ({0}) is not supported: RUN curl under the build's network policy")]
    AddUrl(String),
    #[error("ADD of an archive ({0}) would unpack it, which is not supported: COPY it and RUN tar")]
    AddArchive(String),
    #[error("{0}: wildcards in sources are not supported")]
    Wildcard(String),
}

/// Parses `text` with `build_args` (values for its `ARG`s; one it does not declare is an
/// error). `user` and `workdir` stay empty until `USER`/`WORKDIR` set them: the base's apply.
pub fn parse(
    text: &str,
    build_args: &HashMap<String, String>,
) -> Result<Dockerfile, DockerfileError> {
    let mut out = Dockerfile::default();
    let mut vars: HashMap<String, String> = HashMap::new();
    let mut declared: Vec<String> = Vec::new();
    let mut from_line = None;
    for (line, logical) in logical_lines(text) {
        let (word, rest) = logical
            .split_once(|c: char| c.is_ascii_whitespace())
            .map_or((logical.as_str(), ""), |(w, r)| (w, r.trim()));
        let instr = word.to_ascii_uppercase();
        let at = |why: StepError| DockerfileError::Instruction {
            line,
            instr: instr.clone(),
            why,
        };
        if from_line.is_none() && !matches!(instr.as_str(), "FROM" | "ARG") {
            return Err(DockerfileError::BeforeFrom {
                line,
                instr: instr.clone(),
            });
        }
        match instr.as_str() {
            "FROM" => {
                if from_line.is_some() {
                    return Err(at(StepError::SecondFrom));
                }
                out.from = from_image(rest, &vars).map_err(at)?;
                from_line = Some(line);
            }
            "ARG" => declare_arg(rest, build_args, &mut vars, &mut declared).map_err(at)?,
            "ENV" => set_env(rest, &mut vars, &mut out.env).map_err(at)?,
            "WORKDIR" => out.workdir = workdir_of(rest, &vars, &out.workdir).map_err(at)?,
            "USER" => out.user = user_of(rest, &vars).map_err(at)?,
            "RUN" => {
                let step = run_step(rest, &vars, &out).map_err(at)?;
                out.steps.push((line, format!("RUN {rest}"), step));
            }
            "COPY" | "ADD" => {
                let (step, text) = copy(&instr, rest, &vars, &out.workdir).map_err(at)?;
                out.steps.push((line, text, step));
            }
            "ENTRYPOINT" => out.entrypoint = command(rest).map_err(at)?.argv(),
            "CMD" => out.cmd = command(rest).map_err(at)?.argv(),
            "" => {}
            _ => {
                return Err(DockerfileError::Unsupported {
                    line,
                    word: word.to_owned(),
                });
            }
        }
    }
    if from_line.is_none() {
        return Err(DockerfileError::NoFrom);
    }
    if let Some(unused) = build_args.keys().find(|k| !declared.contains(k)) {
        return Err(DockerfileError::UndeclaredArg(unused.clone()));
    }
    Ok(out)
}

/// Parse step: FROM's image (`FROM IMAGE [AS NAME]`), its variables substituted.
fn from_image(rest: &str, vars: &HashMap<String, String>) -> Result<String, StepError> {
    let words: Vec<&str> = rest.split_whitespace().collect();
    let image = match words.as_slice() {
        [image] => *image,
        [image, as_, _name] if as_.eq_ignore_ascii_case("as") => *image,
        _ => return Err(StepError::FromForm),
    };
    substitute(image, vars)
}

/// Parse step: an ARG declared, its value (the build argument's, else its default) set.
fn declare_arg(
    rest: &str,
    build_args: &HashMap<String, String>,
    vars: &mut HashMap<String, String>,
    declared: &mut Vec<String>,
) -> Result<(), StepError> {
    let (name, default) = match rest.split_once('=') {
        Some((n, d)) => (n.trim(), Some(unquote(d.trim()))),
        None => (rest.trim(), None),
    };
    check_var_name(name)?;
    declared.push(name.to_owned());
    let value = build_args.get(name).cloned().or(default);
    if let Some(v) = value {
        let v = substitute(&v, vars)?;
        vars.insert(name.to_owned(), v);
    }
    Ok(())
}

/// Parse step: an ENV's pairs set, as variables and in the template's environment.
fn set_env(
    rest: &str,
    vars: &mut HashMap<String, String>,
    env: &mut BTreeMap<String, String>,
) -> Result<(), StepError> {
    for (k, v) in env_pairs(rest)? {
        let v = substitute(&v, vars)?;
        vars.insert(k.clone(), v.clone());
        env.insert(k, v);
    }
    Ok(())
}

/// Parse step: the directory a WORKDIR leaves (a relative one is under `current`).
fn workdir_of(
    rest: &str,
    vars: &HashMap<String, String>,
    current: &str,
) -> Result<String, StepError> {
    let dir = substitute(&unquote(rest), vars)?;
    if dir.is_empty() {
        return Err(StepError::EmptyWorkdir);
    }
    if dir.starts_with('/') {
        return Ok(dir);
    }
    let base = if current.is_empty() { "/" } else { current };
    Ok(format!("{}/{dir}", base.trim_end_matches('/')))
}

/// Parse step: the account a USER names (one word).
fn user_of(rest: &str, vars: &HashMap<String, String>) -> Result<String, StepError> {
    let user = substitute(rest, vars)?;
    if user.is_empty() || user.contains(char::is_whitespace) {
        return Err(StepError::UserForm);
    }
    Ok(user)
}

/// Parse step: a RUN's step, with the user, directory and environment as they stand in `out`.
fn run_step(
    rest: &str,
    vars: &HashMap<String, String>,
    out: &Dockerfile,
) -> Result<Step, StepError> {
    if rest.starts_with("--") {
        return Err(StepError::RunFlags);
    }
    let command = command(rest)?;
    let mut env: BTreeMap<String, String> =
        vars.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    env.extend(out.env.clone());
    Ok(Step::Run {
        command,
        user: out.user.clone(),
        workdir: out.workdir.clone(),
        env,
    })
}

/// Lines joined at trailing backslashes, comments and blank lines dropped, with the number of
/// each logical line's first line.
fn logical_lines(text: &str) -> Vec<(usize, String)> {
    let mut out = Vec::new();
    let mut current: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if trimmed.starts_with('#') || (trimmed.is_empty() && current.is_none()) {
            continue;
        }
        let (body, more) = match trimmed.strip_suffix('\\') {
            Some(b) => (b, true),
            None => (trimmed, false),
        };
        let entry = current.get_or_insert_with(|| (i + 1, String::new()));
        if !entry.1.is_empty() && !body.is_empty() {
            entry.1.push(' ');
        }
        entry.1.push_str(body.trim());
        if !more && let Some(done) = current.take() {
            out.push(done);
        }
    }
    out.extend(current);
    out
}

fn check_var_name(name: &str) -> Result<(), StepError> {
    let ok = !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
    if ok {
        Ok(())
    } else {
        Err(StepError::VariableName(name.to_owned()))
    }
}

fn unquote(s: &str) -> String {
    let s = s.trim();
    for q in ['"', '\''] {
        if s.len() >= 2 && s.starts_with(q) && s.ends_with(q) {
            return s[1..s.len() - 1].to_owned();
        }
    }
    s.to_owned()
}

/// `$NAME`, `${NAME}` and `${NAME:-word}` from `vars` (unset: empty); `\$` is a literal `$`.
fn substitute(s: &str, vars: &HashMap<String, String>) -> Result<String, StepError> {
    let mut out = String::new();
    let mut chars = s.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\\' if chars.peek() == Some(&'$') => {
                out.push('$');
                chars.next();
            }
            '$' if chars.peek() == Some(&'{') => {
                chars.next();
                let mut inner = String::new();
                loop {
                    match chars.next() {
                        Some('}') => break,
                        Some(c) => inner.push(c),
                        None => return Err(StepError::UnclosedBrace(s.to_owned())),
                    }
                }
                let (name, default) = match inner.split_once(":-") {
                    Some((n, d)) => (n, Some(d)),
                    None => (inner.as_str(), None),
                };
                check_var_name(name)?;
                match (vars.get(name).filter(|v| !v.is_empty()), default) {
                    (Some(v), _) => out.push_str(v),
                    (None, Some(d)) => out.push_str(d),
                    (None, None) => {}
                }
            }
            '$' if chars
                .peek()
                .is_some_and(|c| c.is_ascii_alphabetic() || *c == '_') =>
            {
                let mut name = String::new();
                while let Some(c) = chars
                    .peek()
                    .filter(|c| c.is_ascii_alphanumeric() || **c == '_')
                {
                    name.push(*c);
                    chars.next();
                }
                out.push_str(vars.get(&name).map_or("", String::as_str));
            }
            c => out.push(c),
        }
    }
    Ok(out)
}

/// Words as a shell splits them: whitespace outside quotes separates, quotes group,
/// backslash escapes (kept before `$`, for [`substitute`]).
fn words(s: &str) -> Result<Vec<String>, StepError> {
    let mut out = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let mut chars = s.chars();
    while let Some(c) = chars.next() {
        match c {
            '"' | '\'' => {
                in_word = true;
                loop {
                    match chars.next() {
                        Some(q) if q == c => break,
                        Some('\\') if c == '"' => match chars.next() {
                            Some('$') => cur.push_str("\\$"),
                            Some(e) => cur.push(e),
                            None => return Err(StepError::UnclosedQuote),
                        },
                        Some(x) => cur.push(x),
                        None => return Err(StepError::UnclosedQuote),
                    }
                }
            }
            '\\' => {
                in_word = true;
                match chars.next() {
                    Some('$') => cur.push_str("\\$"),
                    Some(e) => cur.push(e),
                    None => {}
                }
            }
            c if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut cur));
                    in_word = false;
                }
            }
            c => {
                in_word = true;
                cur.push(c);
            }
        }
    }
    if in_word {
        out.push(cur);
    }
    Ok(out)
}

/// `ENV K=V K2="V 2"` or the old `ENV K V with spaces`.
fn env_pairs(rest: &str) -> Result<Vec<(String, String)>, StepError> {
    let ws = words(rest)?;
    let pairs = if ws.first().is_some_and(|w| w.contains('=')) {
        ws.iter()
            .map(|w| {
                w.split_once('=')
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .ok_or_else(|| StepError::NotKeyValue(w.clone()))
            })
            .collect::<Result<Vec<_>, StepError>>()?
    } else {
        let (k, v) = rest
            .split_once(char::is_whitespace)
            .ok_or(StepError::EnvForm)?;
        vec![(k.to_owned(), v.trim().to_owned())]
    };
    for (k, _) in &pairs {
        check_var_name(k)?;
    }
    if pairs.is_empty() {
        return Err(StepError::EnvEmpty);
    }
    Ok(pairs)
}

/// The exec form (a JSON array of strings) or the shell form.
fn command(rest: &str) -> Result<Command, StepError> {
    if rest.is_empty() {
        return Err(StepError::NoCommand);
    }
    if rest.starts_with('[')
        && let Ok(argv) = serde_json::from_str::<Vec<String>>(rest)
    {
        if argv.is_empty() || argv[0].is_empty() {
            return Err(StepError::EmptyExec);
        }
        return Ok(Command::Exec(argv));
    }
    Ok(Command::Shell(rest.to_owned()))
}

fn copy(
    instr: &str,
    rest: &str,
    vars: &HashMap<String, String>,
    workdir: &str,
) -> Result<(Step, String), StepError> {
    let mut ws: Vec<String> = if rest.trim_start().starts_with('[') {
        serde_json::from_str(rest).map_err(StepError::Json)?
    } else {
        words(rest)?
    };
    let (mut chown, mut chmod) = (None, None);
    while ws.first().is_some_and(|w| w.starts_with("--")) {
        let flag = ws.remove(0);
        match flag.split_once('=') {
            Some(("--chown", v)) => chown = Some(substitute(v, vars)?),
            Some(("--chmod", v)) => {
                chmod = Some(
                    u32::from_str_radix(v, 8)
                        .ok()
                        .filter(|m| *m <= 0o7777)
                        .ok_or_else(|| StepError::Chmod(v.to_owned()))?,
                );
            }
            Some(("--from", _)) => {
                return Err(StepError::CopyFrom);
            }
            _ => return Err(StepError::CopyFlag(flag)),
        }
    }
    let ws = ws
        .iter()
        .map(|w| substitute(w, vars))
        .collect::<Result<Vec<_>, StepError>>()?;
    let Some((dest, sources)) = ws.split_last().filter(|(_, s)| !s.is_empty()) else {
        return Err(StepError::CopyForm(instr.to_owned()));
    };
    for s in sources {
        if instr == "ADD" && (s.contains("://") || s.starts_with("git@")) {
            return Err(StepError::AddUrl(s.clone()));
        }
        if instr == "ADD"
            && [".tar", ".tgz", ".tar.gz", ".tar.xz", ".tar.bz2", ".tar.zst"]
                .iter()
                .any(|x| s.ends_with(x))
        {
            return Err(StepError::AddArchive(s.clone()));
        }
        if s.contains(['*', '?', '[']) {
            return Err(StepError::Wildcard(s.clone()));
        }
    }
    let dest = if dest.starts_with('/') {
        dest.clone()
    } else {
        let base = if workdir.is_empty() { "/" } else { workdir };
        format!("{}/{dest}", base.trim_end_matches('/'))
    };
    let text = format!("{instr} {}", ws.join(" "));
    Ok((
        Step::Copy {
            sources: sources.to_vec(),
            dest,
            chown,
            chmod,
        },
        text,
    ))
}

#[cfg(test)]
#[path = "dockerfile_tests.rs"]
mod tests;

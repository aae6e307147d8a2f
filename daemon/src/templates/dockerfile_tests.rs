use super::*;

fn args(kv: &[(&str, &str)]) -> HashMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn instructions_agent_images_use_are_parsed_with_their_variables() {
    let text = r#"# syntax=docker/dockerfile:1
ARG BASE=base
FROM ${BASE} AS build
ARG VERSION=1.0
ENV APP_HOME=/srv/app \
    GREETING="hello world"
ENV OLD style value
WORKDIR $APP_HOME
COPY --chown=user:user requirements.txt ./
# a comment inside
RUN pip install -r requirements.txt && \
    echo "$VERSION"
ADD src/ lib/
USER user
WORKDIR sub
RUN ["python3", "-c", "print(1)"]
ENTRYPOINT ["python3"]
CMD app.py --port ${VERSION}
"#;
    let d = parse(text, &args(&[("VERSION", "2.0")])).unwrap();
    assert_eq!(d.from, "base");
    assert_eq!(d.workdir, "/srv/app/sub");
    assert_eq!(d.user, "user");
    assert_eq!(d.env["APP_HOME"], "/srv/app");
    assert_eq!(d.env["GREETING"], "hello world");
    assert_eq!(d.env["OLD"], "style value");
    assert_eq!(d.entrypoint, ["python3"]);
    assert_eq!(d.cmd, ["/bin/sh", "-c", "app.py --port ${VERSION}"]);
    let lines: Vec<usize> = d.steps.iter().map(|(l, _, _)| *l).collect();
    assert_eq!(lines, [9, 11, 13, 16]);
    let Step::Copy {
        sources,
        dest,
        chown,
        ..
    } = &d.steps[0].2
    else {
        panic!("{:?}", d.steps[0])
    };
    assert_eq!(
        (sources.as_slice(), dest.as_str()),
        (&["requirements.txt".to_string()][..], "/srv/app/./")
    );
    assert_eq!(chown.as_deref(), Some("user:user"));
    let Step::Run {
        command,
        user,
        workdir,
        env,
    } = &d.steps[1].2
    else {
        panic!("{:?}", d.steps[1])
    };
    assert_eq!(
        command,
        &Command::Shell("pip install -r requirements.txt && echo \"$VERSION\"".into())
    );
    assert_eq!((user.as_str(), workdir.as_str()), ("", "/srv/app"));
    assert_eq!(env["VERSION"], "2.0", "ARGs reach RUN's environment");
    let Step::Copy { dest, .. } = &d.steps[2].2 else {
        panic!()
    };
    assert_eq!(dest, "/srv/app/lib/");
    let Step::Run {
        command,
        user,
        workdir,
        ..
    } = &d.steps[3].2
    else {
        panic!()
    };
    assert_eq!(
        command,
        &Command::Exec(vec!["python3".into(), "-c".into(), "print(1)".into()])
    );
    assert_eq!((user.as_str(), workdir.as_str()), ("user", "/srv/app/sub"));
}

#[test]
fn anything_else_is_refused_before_the_build_naming_it_and_its_line() {
    for (text, says) in [
        (
            "FROM base\nRUN true\nEXPOSE 80\n",
            "line 3: EXPOSE is not supported",
        ),
        (
            "FROM base\nHEALTHCHECK CMD true\n",
            "line 2: HEALTHCHECK is not supported",
        ),
        ("RUN true\nFROM base\n", "line 1: RUN before FROM"),
        ("FROM base\nFROM other\n", "line 2: FROM: a second FROM"),
        (
            "FROM base\nCOPY --from=build /a /b\n",
            "line 2: COPY: --from",
        ),
        (
            "FROM base\nADD https://example.com/x /x\n",
            "line 2: ADD: ADD of a URL",
        ),
        (
            "FROM base\nADD app.tar.gz /x\n",
            "line 2: ADD: ADD of an archive",
        ),
        ("FROM base\nCOPY *.py /x/\n", "wildcards"),
        (
            "FROM base\nRUN --mount=type=cache,target=/x true\n",
            "RUN flags",
        ),
        ("FROM base\nENV 1BAD=x\n", "not a variable name"),
        ("FROM base\nCOPY onlyone\n", "COPY SOURCE... DEST"),
        ("# nothing\n", "no FROM"),
    ] {
        let e = parse(text, &HashMap::new()).unwrap_err().to_string();
        assert!(e.contains(says), "{text:?}: {e}");
    }
    let e = parse("FROM base\n", &args(&[("NOPE", "1")]))
        .unwrap_err()
        .to_string();
    assert!(e.contains("NOPE") && e.contains("not declared"), "{e}");
}

#[test]
fn substitution_follows_docker() {
    let vars: HashMap<String, String> = args(&[("A", "x"), ("EMPTY", "")]);
    for (s, want) in [
        ("$A/${A}", "x/x"),
        ("${MISSING:-dflt}", "dflt"),
        ("${EMPTY:-dflt}", "dflt"),
        ("${A:-dflt}", "x"),
        ("\\$A", "$A"),
        ("$MISSING.", "."),
        ("a$", "a$"),
    ] {
        assert_eq!(substitute(s, &vars).unwrap(), want, "{s}");
    }
    assert!(substitute("${A", &vars).is_err());
}
